"""CheckedMatcher: a backend matcher plus the exact checks of a widened schema (schema_checks.py).

It keeps the bytes it consumed and a JSON scanner state (json_scan.py) per token; what it checks, and when, is
described in schema_checks.py. Budget (attempts.py): a mask that forbids the closing token of a failing value is an
attempt of that value; once a value has had ``max_attempts`` of them the row ends with the smallest valid completion
(completion.py); when none is found, or no continuation is left, the row is failed: no token is allowed any more,
and :meth:`CheckedMatcher.error` names the keyword and the schema path that keep failing.
"""

from __future__ import annotations

import json
import logging
from functools import partial

import numpy as np
import torch

from . import bitmask as bm
from .attempts import Attempts
from .completion import smallest_completion
from .json_scan import _BEFORE, _FREE, INITIAL, _items, _key, _parent, _prefixes, _value_path, scan
from .key_lookahead import futile_key, key_pool
from .schema_checks import SchemaChecks, _pointer

logger = logging.getLogger(__name__)


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
        self.budget = Attempts()
        self.failed: str | None = None
        self.failed_at = 0  # tokens consumed when the row failed; a rollback below that point clears the failure
        self.last_failure: str | None = None
        self.fail_start = 0  # text offset where the value of the last failure starts
        self.fail_free = False  # the last failure is structural (a member missing, a repeated key): costs no attempt
        self.retry_reason: str | None = None  # the failure a retry (restart) started from
        self.forbid: dict = {}  # text so far -> token ids masked there (continuations that failed before)
        self.completion: list | None = None  # tokens left of the valid completion that ends this row (completion.py)
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
            state, offset, data = INITIAL, len(opener), full[len(opener) :]
        closes: list = []
        new = scan(state, data, offset, closes)
        if new is None or not closes:
            return new, None
        full = text + raw
        for path, start, end, parent in closes:
            if path is None:  # a key: checked in objects under exact checks (keys in any order among them)
                governed = self.checks.roots_at(self._concrete(parent[1], full))[0]
                fail = self._repeated_key(start, end, parent[0], full) if governed else None
            else:
                fail = self._close_failure(self._concrete(path, full), start, end, parent, full)
            if fail:
                return new, fail
        return new, None

    def _repeated_key(self, start: int, end: int, parent: int, full: bytes) -> str | None:
        """A key equal to an earlier key of its object (the grammar of keys in any order allows it; JSON readers
        would keep one of the two values)."""
        earlier = full[parent:start].rstrip(b" \t\n\r,")
        if earlier == b"{":
            return None
        pairs: list = []
        try:
            json.loads(earlier + b"}", object_pairs_hook=lambda kv: pairs.append(kv) or {})
            key = json.loads(full[start:end])
        except ValueError:
            return None
        if any(k == key for k, _ in pairs[-1]):
            self.fail_start, self.fail_free = start, True
            return f"a repeated key {key!r} in the object at byte {parent}"
        return None

    def _close_failure(self, path: tuple, start: int, end: int, parent, full: bytes) -> str | None:
        """Failure of the value full[start:end] closing at instance `path` (its container starts at `parent`)."""
        checks, _ = self.checks.roots_at(path)
        for sub in checks:
            fail = self.checks.failure(sub, full[start:end])
            if fail:
                self.fail_start, self.fail_free = start, self.checks.wanting(sub, full[start:end])
                return fail
        if path and isinstance(path[-1], int) and path[-1] > 0 and parent is not None:
            if self.checks.roots_at(path[:-1])[1] and self.checks.duplicate(full[parent:end] + b"]"):
                self.fail_start, self.fail_free = parent, False
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
            path and isinstance(path[-1], int) and path[-1] > 0 and self.checks.roots_at(path[:-1])[1]
        )
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
        return tuple(_key(full[s[0] : s[1]]) if isinstance(s, tuple) else s for s in path)

    # ------------------------------------------------------------------ protocol
    def consume(self, tokens):
        if not tokens or self.failed:
            return 0
        n = self.m.validate(tokens)
        ok = self._walk(tokens[:n], commit=True)
        if self.completion is not None:  # the completion's tokens are used up; another token drops it
            done = self.completion[:ok] == list(tokens[:ok])
            self.completion = self.completion[ok:] if done else None
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
            if fail or (futile := self._futile_at(state, text)[0]) and futile(state, text, int(t)):
                self.last_failure = fail or self.last_failure
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
            del self.hist[len(self.hist) - n :]
            del self.text[self.hist[-1][1] :]
            self._gate = {}  # cached by length: another text may reach the same length
            self.completion = None
            self.budget.rollback(len(self.text))
            if self.failed and len(self.hist) - 1 < self.failed_at:
                self.failed = None  # back before the failure (rejected drafts): judged afresh when reached again

    def restart(self, forbid: dict, reason: str | None = None) -> None:
        """After a rollback below a failure `reason` (retry.py): not failed, attempts renewed, `forbid` ({text:
        token ids}) masked from now on."""
        self.retry_reason = reason or self.retry_reason
        self.failed = None
        self.budget = Attempts(self.budget.counted)
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
        if self.completion is not None:  # finishing with the smallest valid completion: its next token, then EOS
            bitmask[index].zero_()
            if self.completion:
                bm.set_tokens(bitmask, index, self.completion[:1], True)
            return
        self.m.fill(bitmask, index)
        if self.forbid:
            banned = self.forbid.get(bytes(self.text))
            if banned:
                bm.set_tokens(bitmask, index, banned, False)
                if not self._alive(bitmask[index].numpy().view(np.uint32)):
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
        forbidden, tried = [], set()  # tried: start offsets of the values whose close failed (attempts)
        for t in np.flatnonzero(candidates).tolist():
            new, fail = self._check_token(state, text, t)
            if not fail and isinstance(new, tuple) and self.checks._last_number[t]:
                fail = self._final_number_failure(new, text, t)
            if fail:
                forbidden.append(t)
                self.last_failure = fail
                if not self.fail_free:
                    tried.add(self.fail_start)
        futile, pool = self._futile_at(state, text)
        if futile:  # an item or a key that can only repeat one (exact pruning: no attempt)
            done = set(forbidden)
            forbidden += [
                t for t in np.flatnonzero(allowed & pool).tolist() if t not in done and futile(state, text, t)
            ]
        if forbidden:
            for t in forbidden:
                words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
            spent = self.budget.add(tried, text, self.checks.max_attempts)
            alive = self._alive(words)
            if alive and spent:  # out of attempts: end with a valid document
                self.completion = smallest_completion(self)
                if self.completion is not None:
                    logger.info(
                        "checked row out of attempts (%s): finished with %d tokens",
                        self.last_failure,
                        len(self.completion),
                    )
                    self.fill(bitmask, index)
                    return
            if not alive or spent:
                self.failed = self.last_failure  # no continuation left, or none found to a valid end: failed
                self.failed_at = len(self.hist) - 1
                bitmask[index].zero_()

    def _alive(self, words) -> bool:
        """A token with bytes left in `words`, or an end where the whole text validates (not just the backend's EOS)."""
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: len(self.checks.token_bytes)]
        return bool((allowed.astype(bool) & self.checks._has["any"]).any()) or (
            self.m.is_accepting() and self._gate_failure() is None
        )

    def _unique_enum(self, frame, full: bytes):
        """Items of the array `frame` (a scanner frame) under uniqueItems whose schema allows only the strings of an
        enum / const: (those strings, the array's path), else None."""
        if frame[0] != "a":
            return None
        path = self._concrete(frame[2], full)
        if not self.checks.roots_at(path)[1]:
            return None
        key = ("unique enum", path, frame[5])
        if key not in self.checks._results:  # (shared by the rows of the schema)
            allowed = None
            for node in self.checks.nodes_at(path + (frame[5],)):
                values = (
                    node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None
                )
                if values is not None:
                    strings = frozenset(v for v in values if isinstance(v, str))
                    if len(strings) < len(values):
                        allowed = ()  # other kinds of values: left to the close check
                        break
                    allowed = strings if allowed is None else allowed & strings
            self.checks._results[key] = (allowed, path) if allowed else None
        return self.checks._results[key]

    def _futile_at(self, state, text: bytes):
        """(fn(state, text, token) -> whether the token leaves only repeats (an enum item, a key), [V] bool tokens to
        try), or (None, None)."""
        if isinstance(state, tuple) and bool(state[0]) and self._unique_enum(state[0][-1], text) is not None:
            return self._futile_item, self.checks._has["any"]
        pool = key_pool(self, state, text)
        return (None, None) if pool is None else (partial(futile_key, self), pool)

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
        present = _items(full[frame[1] : start].rstrip(b" \t\n\r,") + b"]")
        if present is None:
            return False
        if prefix in _prefixes(
            found[0] - present if isinstance(present, set) else frozenset(v for v in found[0] if v not in present)
        ):
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
                body = body[len(opener) :].removesuffix(closer) if body.startswith(opener) else None
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
        other.budget, other.failed, other.last_failure = self.budget.copy(), self.failed, self.last_failure
        other.failed_at, other.retry_reason = self.failed_at, self.retry_reason
        other.fail_start, other.fail_free, other.forbid = self.fail_start, self.fail_free, self.forbid
        other.completion = None if self.completion is None else list(self.completion)
        return other
