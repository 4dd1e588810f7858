"""Exact JSON Schema checks on top of a widened grammar (schema_relax.py), inside the matcher every caller uses.

:class:`CheckedMatcher` wraps a backend matcher (same protocol, see backends.py) and keeps the bytes it consumed and a
JSON scanner state per token. A sub-value governed by a widened keyword is validated with ``jsonschema`` against the
subschemas that certainly apply at its instance path (``properties``, ``items``, ``prefixItems``,
``additionalProperties``, matching ``patternProperties``, ``allOf``, ``$ref``) at the moment it closes:

- ``fill``: a token that would close a governed sub-value with an invalid value is masked (the failing continuation
  is forbidden before it is sampled, so no caller has to undo it); an array under ``uniqueItems`` also masks the
  token that closes a duplicate item;
- ``consume`` / ``validate``: stop before such a token (drafts of speculative decoding are checked the same way);
- ``is_accepting``: EOS only where the whole text validates against the whole schema (the final gate: nothing that
  fails the validator ever ends a row).

Budget: every mask that forbids a closing token is an attempt; after ``max_attempts`` of them (per row) the row is
failed: no token is allowed any more, and :meth:`CheckedMatcher.error` names the keyword and the schema path that keep
failing (the matcher turns that into the finish reason ``check_failed: ...``).
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from functools import lru_cache

import numpy as np
import torch

from . import bitmask as bm
from .errors import GrammarError
from .schema_relax import walk

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 64
_NUMBER_BYTES = frozenset(b"0123456789+-.eE")
_WS = frozenset(b" \t\n\r")


# ----------------------------------------------------------------------------------------------------- formats
def _format_checker():
    """jsonschema's format checker plus exact checks for the common formats it needs extra packages for."""
    import jsonschema

    checker = jsonschema.FormatChecker()
    rfc3339_time = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"

    def _date_time(value):
        if not isinstance(value, str):
            return True
        m = re.fullmatch(r"(\d{4}-\d{2}-\d{2})[Tt ]" + rfc3339_time, value, re.ASCII)
        if not m:
            return False
        try:
            datetime.date.fromisoformat(m.group(1))
        except ValueError:
            return False
        return True

    def _time(value):
        return not isinstance(value, str) or re.fullmatch(rfc3339_time, value, re.ASCII) is not None

    def _uri(value):  # RFC 3986 absolute URI: scheme ":" then allowed characters only
        return not isinstance(value, str) or re.fullmatch(
            r"[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*", value) is not None

    def _uri_reference(value):
        return not isinstance(value, str) or re.fullmatch(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*", value) is not None

    def _hostname(value):
        return not isinstance(value, str) or (len(value) <= 253 and re.fullmatch(
            r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?",
            value, re.ASCII) is not None)

    def _duration(value):
        return not isinstance(value, str) or re.fullmatch(
            r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?", value, re.ASCII) is not None

    def _json_pointer(value):
        return not isinstance(value, str) or re.fullmatch(r"(/([^~/]|~[01])*)*", value) is not None

    for name, fn in (("date-time", _date_time), ("time", _time), ("uri", _uri), ("uri-reference", _uri_reference),
                     ("iri", _uri), ("iri-reference", _uri_reference), ("hostname", _hostname),
                     ("duration", _duration), ("json-pointer", _json_pointer)):
        if name not in checker.checkers:
            checker.checks(name)(fn)
    return checker


@lru_cache(maxsize=1)
def format_checker():
    return _format_checker()


def known_formats() -> frozenset:
    return frozenset(format_checker().checkers)


# ----------------------------------------------------------------------------------------------- JSON scanning
# Before the scanner states, in a tagged_json grammar (SchemaChecks.frame): inside the open tag, and free text.
_BEFORE, _FREE = "before", "free"
# A scanner state is immutable: (stack, scalar, top). stack: tuple of frames (kind "o"/"a", start offset, path,
# phase, key, index); scalar: None or ("s", start, is_key, escaped) / ("n", start) / ("l", start, bytes left);
# top: "start" | "done" (the top-level value closed).
INITIAL = ((), None, "start")


def _value_path(stack) -> tuple:
    if not stack:
        return ()
    kind, _, path, _, key, index = stack[-1]
    return path + ((key,) if kind == "o" else (index,))


def scan(state, data: bytes, offset: int, closes: list):
    """Advance `state` over `data` (bytes starting at text offset `offset`); append (path, start, end) of every value
    that closes, in order, to `closes` as (path, start, end, start of its container or None). Returns the new state
    (None if `data` is not JSON: the grammar decides)."""
    stack, scalar, top = state
    pos = offset
    for b in data:
        # ---- inside a scalar
        if scalar is not None:
            kind = scalar[0]
            if kind == "s":
                if scalar[3]:
                    scalar = ("s", scalar[1], scalar[2], False)
                elif b == 0x5C:  # backslash
                    scalar = ("s", scalar[1], scalar[2], True)
                elif b == 0x22:  # closing quote
                    start, is_key = scalar[1], scalar[2]
                    scalar = None
                    if is_key:
                        frame = stack[-1]
                        stack = stack[:-1] + ((frame[0], frame[1], frame[2], ":", (start, pos + 1), frame[5]),)
                    else:
                        closes.append((_value_path(stack), start, pos + 1, _parent(stack)))
                        stack, top = _after_value(stack, top)
                pos += 1
                continue
            if kind == "l":
                left = scalar[2] - 1
                if left == 0:
                    closes.append((_value_path(stack), scalar[1], pos + 1, _parent(stack)))
                    scalar = None
                    stack, top = _after_value(stack, top)
                else:
                    scalar = ("l", scalar[1], left)
                pos += 1
                continue
            if b in _NUMBER_BYTES:
                pos += 1
                continue
            closes.append((_value_path(stack), scalar[1], pos, _parent(stack)))  # a number ends before this byte
            scalar = None
            stack, top = _after_value(stack, top)
        # ---- between tokens of the structure
        if b in _WS:
            pos += 1
            continue
        if stack:
            kind, start, path, phase, key, index = stack[-1]
            if kind == "o":
                if phase in ("k?", "k") and b == 0x22:
                    scalar = ("s", pos, True, False)
                elif phase == "k?" and b == 0x7D or phase == "," and b == 0x7D:
                    closes.append((path, start, pos + 1, _parent(stack[:-1])))
                    stack, top = _after_value(stack[:-1], top)
                elif phase == "," and b == 0x2C:
                    stack = stack[:-1] + ((kind, start, path, "k", None, index),)
                elif phase == ":" and b == 0x3A:
                    stack = stack[:-1] + ((kind, start, path, "v", key, index),)
                elif phase == "v":
                    stack, scalar = _open_value(stack, b, pos)
                    if stack is None:
                        return None
                else:
                    return None
            else:
                if phase in ("v?", ",") and b == 0x5D:
                    closes.append((path, start, pos + 1, _parent(stack[:-1])))
                    stack, top = _after_value(stack[:-1], top)
                elif phase == "," and b == 0x2C:
                    stack = stack[:-1] + ((kind, start, path, "v", None, index + 1),)
                elif phase in ("v?", "v"):
                    stack = stack[:-1] + ((kind, start, path, "v", None, index),)
                    stack, scalar = _open_value(stack, b, pos)
                    if stack is None:
                        return None
                else:
                    return None
        elif top == "start":
            stack, scalar = _open_value(stack, b, pos)
            if stack is None:
                return None
            top = "value"
        else:
            return None
        pos += 1
    return stack, scalar, top


def _parent(stack):
    """Text offset where the innermost open container starts (None at the top level)."""
    return stack[-1][1] if stack else None


def _open_value(stack, b, pos):
    """A value starts with byte b at pos -> (stack, scalar); (None, None) for a byte that starts no value."""
    if b == 0x22:
        return stack, ("s", pos, False, False)
    if b == 0x7B:
        return stack + (("o", pos, _value_path(stack), "k?", None, 0),), None
    if b == 0x5B:
        return stack + (("a", pos, _value_path(stack), "v?", None, 0),), None
    if b in _NUMBER_BYTES:
        return stack, ("n", pos)
    if b == 0x74 or b == 0x6E:  # true / null
        return stack, ("l", pos, 3)
    if b == 0x66:  # false
        return stack, ("l", pos, 4)
    return None, None


def _after_value(stack, top):
    if not stack:
        return stack, "done"
    kind, start, path, _, key, index = stack[-1]
    return stack[:-1] + ((kind, start, path, ",", key, index),), top


# ------------------------------------------------------------------------------------------------- the schema
class SchemaChecks:
    """The exact side of a widened schema, shared by every row compiled from it.

    schema: the original schema; modified: ids of its widened subschemas (schema_relax.Relaxed.modified);
    token_bytes: bytes of every token id (for the look-ahead masks). frame: (open, close) bytes of a tagged_json
    grammar: the JSON sits between them, and text that does not start with `open` is free text (nothing to check).
    """

    def __init__(self, schema: dict, modified: set, token_bytes: list, notes=(), max_attempts: int = MAX_ATTEMPTS,
                 frame: tuple[bytes, bytes] | None = None):
        import jsonschema
        from jsonschema.validators import validator_for

        self.schema = schema
        self.frame = frame
        self.notes = tuple(notes)
        self.max_attempts = max_attempts
        cls = validator_for(schema, default=jsonschema.Draft202012Validator)
        self.legacy_ref = cls.META_SCHEMA.get("$schema", "") in (
            "http://json-schema.org/draft-03/schema#", "http://json-schema.org/draft-04/schema#",
            "http://json-schema.org/draft-06/schema#", "http://json-schema.org/draft-07/schema#")
        self.validator = cls(schema, format_checker=format_checker())
        self._unique = cls({"uniqueItems": True})
        self.pointers = {id(s): p for p, s in walk(schema)}
        self.modified = set(modified)
        self._subtree_memo: dict = {}
        self._nodes: dict = {}
        self._roots: dict = {}
        self._sub_validators: dict = {}
        self._results: dict = {}
        self.token_bytes = token_bytes
        lengths = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=len(token_bytes))
        self._has = {}
        for name, chars in (("quote", b'"'), ("close", b'"]},' + b" \t\n\r"), ("any", None)):
            self._has[name] = np.array([bool(t) and (chars is None or any(c in t for c in chars))
                                        for t in token_bytes], dtype=bool) & (lengths > 0)
        self._first_number = np.array([bool(t) and t[0] in _NUMBER_BYTES for t in token_bytes], dtype=bool)
        self._last_number = np.array([bool(t) and t[-1] in _NUMBER_BYTES for t in token_bytes], dtype=bool)

    # ------------------------------------------------------------------ schema locations
    def _resolve(self, ref: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        try:
            return self.validator._resolver.lookup(ref).contents
        except Exception:  # noqa: BLE001  (unresolvable here: no sub-value check below it; the final gate has it)
            return None

    def _expand(self, schemas) -> list:
        """Subschemas that certainly apply at the same instance location (closure over $ref and allOf)."""
        out, seen, todo = [], set(), list(schemas)
        while todo:
            s = todo.pop()
            if not isinstance(s, dict) or id(s) in seen:
                continue
            seen.add(id(s))
            out.append(s)
            if "$ref" in s:
                target = self._resolve(s["$ref"])
                if target is not None:
                    todo.append(target)
                if self.legacy_ref:
                    continue
            if isinstance(s.get("allOf"), list):
                todo.extend(s["allOf"])
        return out

    def nodes_at(self, path: tuple) -> list:
        """Subschemas that certainly apply to the instance at `path` (keys and indices)."""
        hit = self._nodes.get(path)
        if hit is not None:
            return hit
        if not path:
            nodes = self._expand([self.schema])
        else:
            children = []
            step = path[-1]
            for s in self.nodes_at(path[:-1]):
                children.extend(self._child(s, step))
            nodes = self._expand(children)
        self._nodes[path] = nodes
        return nodes

    def _child(self, s: dict, step) -> list:
        if isinstance(step, str):
            found, out = False, []
            props = s.get("properties")
            if isinstance(props, dict) and step in props:
                out.append(props[step])
                found = True
            pats = s.get("patternProperties")
            if isinstance(pats, dict):
                for pat, sub in pats.items():
                    try:
                        if re.search(pat, step):
                            out.append(sub)
                            found = True
                    except re.error:
                        found = True  # unknown: nothing certain about additionalProperties
            if not found and isinstance(s.get("additionalProperties"), dict):
                out.append(s["additionalProperties"])
            return out
        prefix = s.get("prefixItems")
        items = s.get("items")
        if isinstance(prefix, list):
            if step < len(prefix):
                return [prefix[step]]
            return [items] if isinstance(items, dict) else []
        if isinstance(items, list):
            if step < len(items):
                return [items[step]]
            extra = s.get("additionalItems")
            return [extra] if isinstance(extra, dict) else []
        return [items] if isinstance(items, dict) else []

    def _subtree_modified(self, s, seen=None) -> bool:
        if not isinstance(s, dict):
            return False
        key = id(s)
        if key in self._subtree_memo:
            return self._subtree_memo[key]
        seen = set() if seen is None else seen
        if key in seen:
            return False
        seen.add(key)
        result = key in self.modified
        if not result:
            for _, sub in walk(s):
                if id(sub) in self.modified:
                    result = True
                    break
                if "$ref" in sub and self._subtree_modified(self._resolve(sub["$ref"]), seen):
                    result = True
                    break
        self._subtree_memo[key] = result
        return result

    def _needs_check(self, s: dict) -> bool:
        if id(s) in self.modified:
            return True
        branches = []
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                branches.extend(s[key])
        for key in ("not", "if", "then", "else", "contains", "propertyNames"):
            branches.append(s.get(key))
        for key in ("dependentSchemas", "dependencies"):
            if isinstance(s.get(key), dict):
                branches.extend(s[key].values())
        return any(self._subtree_modified(b) for b in branches)

    def roots_at(self, path: tuple) -> tuple:
        """(check subschemas, uniqueItems?) at `path`: the subschemas a value there is validated against on close."""
        hit = self._roots.get(path)
        if hit is None:
            nodes = self.nodes_at(path)
            checks = tuple(s for s in nodes if self._needs_check(s))
            unique = any(s.get("uniqueItems") is True for s in nodes)
            hit = self._roots[path] = (checks, unique)
        return hit

    # ------------------------------------------------------------------ validation
    def failure(self, sub: dict, value_bytes: bytes) -> str | None:
        """None if the value validates against `sub`, else "'keyword' at <schema path>" (cached)."""
        key = (id(sub), value_bytes)
        if key in self._results:
            return self._results[key]
        try:
            value = json.loads(value_bytes)
        except ValueError:
            return None  # not JSON yet: the grammar decides
        v = self._sub_validators.get(id(sub))
        if v is None:
            v = self._sub_validators[id(sub)] = self.validator.evolve(schema=sub)
        result = None
        try:
            errors = list(v.iter_errors(value))
        except Exception as err:  # noqa: BLE001  (unresolvable $ref, bad pattern: the value cannot be proven valid)
            result = f"schema at {self.pointers.get(id(sub), '#')} cannot be evaluated ({type(err).__name__}: {err})"
        else:
            if errors:
                import jsonschema

                best = jsonschema.exceptions.best_match(errors)
                where = self.pointers.get(id(sub), "#")
                rel = "/".join(str(p) for p in best.schema_path)
                result = f"{best.validator!r} at {where}{'/' + rel if rel else ''}"
        if len(self._results) > 65536:
            self._results.clear()
        self._results[key] = result
        return result

    def duplicate(self, items_bytes: bytes) -> bool:
        """Whether the JSON array text `items_bytes` has two equal items (jsonschema's uniqueItems equality)."""
        key = ("unique", items_bytes)
        if key not in self._results:
            try:
                self._results[key] = not self._unique.is_valid(json.loads(items_bytes))
            except ValueError:
                self._results[key] = False
        return self._results[key]


# ------------------------------------------------------------------------------------------------ the matcher
class CheckedMatcher:
    """A backend matcher (backends.Matcher protocol) plus the exact checks of `checks` (module docstring)."""

    retryable = True  # a failed check rewinds to retry_point() and restart()s with the failing continuation banned

    def __init__(self, inner, checks: SchemaChecks):
        self.m = inner
        self.checks = checks
        self.words = (len(checks.token_bytes) + 31) // 32
        self.text = bytearray()
        self.hist = [(_BEFORE if checks.frame else INITIAL, 0)]  # scanner state and text length after each token
        self.attempts = 0
        self.failed: str | None = None
        self.failed_at = 0  # tokens consumed when the row failed; a rollback below that point clears the failure
        self.last_failure: str | None = None
        self.fail_start = 0  # text offset where the value of the last failure starts
        self.retry_reason: str | None = None  # the failure a retry (restart) started from
        self.forbid: dict = {}  # text so far -> token ids masked there (continuations that failed before)
        self._gate: dict = {}

    # ------------------------------------------------------------------ checking one token
    def _check_token(self, state, text: bytes, token: int):
        """(new scanner state, failure or None) for appending `token` at scanner `state` over `text`."""
        if state is None:  # the scanner lost track (not JSON text): only the final gate checks from here
            return None, None
        data = self.checks.token_bytes[token] if token < len(self.checks.token_bytes) else b""
        if state == _FREE:
            return state, None
        offset, raw = len(text), data
        if state == _BEFORE:  # a tagged_json grammar before its JSON: the open tag, or free text
            opener, full = self.checks.frame[0], text + data
            if not (full.startswith(opener) or opener.startswith(full)):
                return _FREE, None
            if len(full) <= len(opener):
                return _BEFORE, None
            state, offset, data = INITIAL, len(opener), full[len(opener):]
        closes: list = []
        new = scan(state, data, offset, closes)
        if new is None or not closes:
            return new, None
        full = text + raw
        for path, start, end, parent in closes:
            fail = self._close_failure(self._concrete(path, full), start, end, parent, full)
            if fail:
                return new, fail
        return new, None

    def _close_failure(self, path: tuple, start: int, end: int, parent, full: bytes) -> str | None:
        """Failure of the value full[start:end] closing at instance `path` (its container starts at `parent`)."""
        checks, _ = self.checks.roots_at(path)
        for sub in checks:
            fail = self.checks.failure(sub, full[start:end])
            if fail:
                self.fail_start = start
                return fail
        if path and isinstance(path[-1], int) and path[-1] > 0 and parent is not None:
            if self.checks.roots_at(path[:-1])[1] and self.checks.duplicate(full[parent:end] + b"]"):
                self.fail_start = parent
                return f"'uniqueItems' at the array {_pointer(path[:-1])} (item {path[-1]} repeats one)"
        return None

    def _final_number_failure(self, new_state, text: bytes, token: int) -> str | None:
        """A governed number left open by `token` that the grammar cannot extend (``"6"`` under ``maximum: 9``) is
        complete: its failure, checked now so that the token is masked (else only a dead end would follow)."""
        stack, scalar, _ = new_state
        if scalar is None or scalar[0] != "n":
            return None
        full = text + self.checks.token_bytes[token]
        path = self._concrete(_value_path(stack), full)
        governed = self.checks.roots_at(path)[0] or (
            path and isinstance(path[-1], int) and path[-1] > 0 and self.checks.roots_at(path[:-1])[1])
        if not governed:
            return None
        probe = self.m.clone()
        if probe.consume([token]) != 1:
            return None
        mask = torch.full((1, self.words), -1, dtype=torch.int32)
        probe.fill(mask, 0)
        nxt = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[: len(self.checks.token_bytes)]
        if (nxt.astype(bool) & self.checks._first_number).any():
            return None
        return self._close_failure(path, scalar[1], len(full), _parent(stack), full)

    @staticmethod
    def _concrete(path, full: bytes) -> tuple:
        """Key spans (start, end) in the path -> the key strings."""
        out = []
        for step in path:
            if isinstance(step, tuple):
                try:
                    step = json.loads(full[step[0]: step[1]])
                except ValueError:
                    step = ""
            out.append(step)
        return tuple(out)

    # ------------------------------------------------------------------ protocol
    def consume(self, tokens):
        if not tokens or self.failed:
            return 0
        n = self.m.validate(tokens)
        ok = self._walk(tokens[:n], commit=True)
        if ok:
            done = self.m.consume(tokens[:ok])
            if done != ok:
                raise RuntimeError(f"grammar backend consumed {done} of {ok} validated tokens")
        return ok

    def validate(self, tokens):
        if not tokens or self.failed:
            return 0
        n = self.m.validate(tokens)
        return self._walk(tokens[:n], commit=False)

    def _walk(self, tokens, commit: bool) -> int:
        state, length = self.hist[-1]
        text = bytes(self.text)
        added = []
        for i, t in enumerate(tokens):
            new, fail = self._check_token(state, text, int(t))
            if fail:
                self.last_failure = fail
                break
            data = self.checks.token_bytes[int(t)] if int(t) < len(self.checks.token_bytes) else b""
            text += data
            state = new
            added.append((state, len(text), data))
        if commit:
            for state_i, length_i, data in added:
                self.text += data
                self.hist.append((state_i, length_i))
        return len(added)

    def rollback(self, n):
        if n:
            self.m.rollback(n)
            del self.hist[len(self.hist) - n:]
            del self.text[self.hist[-1][1]:]
            self._gate = {}  # cached by length: another text may reach the same length
            if self.failed and len(self.hist) - 1 < self.failed_at:
                self.failed = None  # back before the failure (rejected drafts): judged afresh when reached again

    def restart(self, forbid: dict, reason: str | None = None) -> None:
        """After a rollback below a failure `reason` (retry.py): not failed, attempts renewed, `forbid` ({text:
        token ids}) masked from now on."""
        self.retry_reason = reason or self.retry_reason
        self.failed = None
        self.attempts = 0
        self.forbid = forbid

    def _needs_lookahead(self, state) -> bool:
        if not isinstance(state, tuple):
            return False  # free text, or a tagged_json grammar's open tag
        stack, scalar, top = state
        if top == "done":
            return False
        text = bytes(self.text)
        for frame in stack:
            checks, unique = self.checks.roots_at(self._concrete(frame[2], text))
            if checks or unique:
                return True
        path = self._concrete(_value_path(stack), text)
        checks, _ = self.checks.roots_at(path)
        if checks:
            return True
        return bool(path) and isinstance(path[-1], int) and self.checks.roots_at(path[:-1])[1]

    def fill(self, bitmask, index):
        if self.failed:
            bitmask[index].zero_()
            return
        self.m.fill(bitmask, index)
        if self.forbid:
            banned = self.forbid.get(bytes(self.text))
            if banned:
                bm.set_tokens(bitmask, index, banned, False)
                if not bm.any_allowed(bitmask, index, len(self.checks.token_bytes)) and not (
                        self.m.is_accepting() and self._gate_failure() is None):
                    # the retried value has no other continuation here: the check still fails (not a dead end)
                    self.failed = self.last_failure or self.retry_reason or "a retried value"
                    self.failed_at = len(self.hist) - 1
                    self.fail_start = len(self.text)  # a retry backs up one more token (retry.py)
                    return
        state = self.hist[-1][0]
        if state is None or not self._needs_lookahead(state):
            return
        words = bitmask[index].numpy().view(np.uint32)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: len(self.checks.token_bytes)].astype(bool)
        scalar = state[1]
        kind = scalar[0] if scalar is not None else None
        cls = "quote" if kind == "s" else ("close" if kind == "n" else "any")
        candidates = allowed & self.checks._has[cls]
        if scalar is None or scalar[0] == "n":  # numbers the grammar will have to close
            candidates |= allowed & self.checks._last_number
        text = bytes(self.text)
        forbidden = []
        for t in np.flatnonzero(candidates).tolist():
            new, fail = self._check_token(state, text, t)
            if not fail and isinstance(new, tuple) and self.checks._last_number[t]:
                fail = self._final_number_failure(new, text, t)
            if fail:
                forbidden.append(t)
                self.last_failure = fail
        checked = len(forbidden)  # closes that failed: attempts; the pruning below is exact and costs none
        if self._in_unique_enum_array(state, text):  # an item that can only repeat one: masked where it starts
            done = set(forbidden)
            for t in np.flatnonzero(allowed).tolist():
                if t not in done and self._futile_item(state, text, t):
                    forbidden.append(t)
        if forbidden:
            for t in forbidden:
                words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
            self.attempts += checked > 0
            if self.attempts >= self.checks.max_attempts or not (
                    words.any() or self.m.is_accepting() and self._gate_failure() is None):
                self.failed = self.last_failure  # out of attempts, or no continuation left: the row fails
                self.failed_at = len(self.hist) - 1
                bitmask[index].zero_()

    def _unique_enum(self, frame, full: bytes):
        """Items of the array `frame` (a scanner frame) under uniqueItems whose schema allows only the strings of an
        enum / const: (those strings, the array's path), else None."""
        if frame[0] != "a":
            return None
        path = self._concrete(frame[2], full)
        if not self.checks.roots_at(path)[1]:
            return None
        allowed = None
        for node in self.checks.nodes_at(path + (frame[5],)):
            values = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node \
                else None
            if values is not None:
                strings = {v for v in values if isinstance(v, str)}
                if len(strings) < len(values):
                    return None  # other kinds of values: left to the close check
                allowed = strings if allowed is None else allowed & strings
        return (allowed, path) if allowed is not None else None

    def _in_unique_enum_array(self, state, text: bytes) -> bool:
        return isinstance(state, tuple) and bool(state[0]) and self._unique_enum(state[0][-1], text) is not None

    def _futile_item(self, state, text: bytes, token: int) -> bool:
        """Whether `token` leaves a string item of a uniqueItems array of enum strings open with a prefix that only
        items already in the array complete, or starts a new item when every string is in the array already (every
        completion repeats one: the close would fail later)."""
        new, fail = self._check_token(state, text, token)
        if fail or not isinstance(new, tuple) or not new[0]:
            return False
        full = text + self.checks.token_bytes[token]
        frame, scalar = new[0][-1], new[1]
        if scalar is None and frame[3] != "v" or scalar is not None and (scalar[0] != "s" or scalar[2]):
            return False  # neither inside a string item nor right after a comma (where an item must follow)
        start = scalar[1] if scalar is not None else len(full)
        found = self._unique_enum(frame, full)
        prefix = full[start:]
        if found is None or b"\\" in prefix:
            return False
        try:
            present = json.loads(full[frame[1]: start].rstrip(b" \t\n\r,") + b"]")
        except ValueError:
            return False
        left = [v for v in found[0] if v not in present]
        forms = {json.dumps(v, ensure_ascii=a).encode() for v in left for a in (True, False)}
        if any(f.startswith(prefix) for f in forms):
            return False
        self.last_failure = f"'uniqueItems' at the array {_pointer(found[1])} (item {frame[5]} can only repeat one)"
        self.fail_start = frame[1]
        return True

    def _gate_failure(self) -> str | None:
        """None if the whole text validates against the whole schema (cached per length)."""
        n = len(self.text)
        if n not in self._gate:
            body = bytes(self.text)
            if self.checks.frame:  # tagged_json: free text passes; the JSON between the tags is checked
                opener, closer = self.checks.frame
                body = body[len(opener):].removesuffix(closer) if body.startswith(opener) else None
            fail = None if body is None else self.checks.failure(self.checks.schema, body)
            if fail is None and body is not None:
                try:
                    json.loads(body)
                except ValueError:
                    fail = "incomplete JSON"
            self._gate = {n: fail}
        return self._gate[n]

    def is_accepting(self):
        if not self.m.is_accepting() or self.failed:
            return False
        fail = self._gate_failure()
        if fail:
            self.last_failure, self.fail_start = fail, 0
        return fail is None

    def is_stopped(self):
        return self.m.is_stopped() and self.is_accepting()

    def error(self):
        if self.failed:
            return f"check_failed: {self.failed}"
        if self.m.is_stopped() and self.m.is_accepting() and self._gate_failure():
            return f"check_failed: {self._gate_failure()}"
        return self.m.error()

    def retry_point(self) -> tuple[int, bytes] | None:
        """After a failure: (tokens to keep: those before the failing value, the text before the last token). The
        caller rolls back to the kept tokens and forbids the last token after that text (a continuation with no
        valid end, or abandoned when the attempts ran out). None if no token was consumed."""
        if len(self.hist) < 2:
            return None
        keep = max(j for j, (_, length) in enumerate(self.hist) if length <= self.fail_start)
        return keep, bytes(self.text[: self.hist[-2][1]])

    def forced_tokens(self):
        ff = self.m.forced_tokens()
        return ff[: self.validate(ff)] if ff else []

    def clone(self):
        other = CheckedMatcher(self.m.clone(), self.checks)
        other.text = bytearray(self.text)
        other.hist = list(self.hist)
        other.attempts, other.failed, other.last_failure = self.attempts, self.failed, self.last_failure
        other.failed_at, other.retry_reason = self.failed_at, self.retry_reason
        other.fail_start, other.forbid = self.fail_start, self.forbid
        return other


def check_schema(schema: dict) -> None:
    """GrammarError naming the place of the first error of `schema` against its meta-schema (formats included:
    a ``pattern`` must be a regex)."""
    import jsonschema
    from jsonschema.validators import validator_for

    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        error = jsonschema.exceptions.best_match(
            cls(cls.META_SCHEMA, format_checker=format_checker()).iter_errors(schema))
    except Exception as err:  # noqa: BLE001  (a meta-schema jsonschema cannot load: the backend decides)
        logger.debug("meta-schema check skipped: %s", err)
        return
    if error is not None:
        where = "#" + "".join(f"/{p}" for p in error.absolute_path)
        raise GrammarError(f"json_schema: invalid at {where} ({error.validator!r}): {error.message}")


def _pointer(path) -> str:
    """Instance path -> JSON pointer text."""
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path) if path else "(root)"


def schema_checks_for(schema, relaxed, token_bytes, frame=None) -> SchemaChecks | None:
    """SchemaChecks for a schema widened by `relaxed` (None when nothing was widened: the grammar is exact).
    frame: (open, close) tags of a tagged_json grammar (str)."""
    if not relaxed.modified:
        return None
    try:
        return SchemaChecks(schema, relaxed.modified, token_bytes, notes=relaxed.notes,
                            frame=tuple(t.encode() for t in frame) if frame else None)
    except Exception as err:  # noqa: BLE001  (jsonschema rejects the schema itself)
        raise GrammarError(f"json_schema: cannot be checked exactly ({type(err).__name__}: {err})") from None
