"""Exact JSON Schema checks on top of a widened grammar (schema_relax.py): which subschemas govern a value, and
whether a closed value passes them. The matcher that runs them per token is checked_matcher.py.

A sub-value governed by a widened keyword is validated with ``jsonschema`` against the subschemas that certainly
apply at its instance path (``properties``, ``items``, ``prefixItems``, ``additionalProperties``, matching
``patternProperties``, ``allOf``, ``$ref``) at the moment it closes:

- ``fill``: a token that would close a governed sub-value with an invalid value is masked (the failing continuation
  is forbidden before it is sampled, so no caller has to undo it); an array under ``uniqueItems`` also masks the
  token that closes a duplicate item;
- ``consume`` / ``validate``: stop before such a token (drafts of speculative decoding are checked the same way);
- ``is_accepting``: EOS only where the whole text validates against the whole schema (the final gate: nothing that
  fails the validator ever ends a row).
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np

from .errors import GrammarError
from .formats import format_checker
from .json_scan import _NUMBER_BYTES
from .schema_relax import walk

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 64  # refused closes of one value (attempts.py)
_WANTING = frozenset({"required", "minProperties", "dependentRequired"})


# ------------------------------------------------------------------------------------------------- the schema
class SchemaChecks:
    """The exact side of a widened schema, shared by every row compiled from it.

    schema: the original schema; modified: ids of its widened subschemas (schema_relax.Relaxed.modified);
    token_bytes: bytes of every token id (for the look-ahead masks). frame: (open, close) bytes of a tagged_json
    grammar: the JSON sits between them, and text that does not start with `open` is free text (nothing to check).
    """

    def __init__(
        self,
        schema: dict,
        modified: set,
        token_bytes: list,
        notes=(),
        max_attempts: int | None = None,
        frame: tuple[bytes, bytes] | None = None,
    ):
        import jsonschema
        from jsonschema.validators import validator_for

        self.schema = schema
        self.frame = frame
        self.notes = tuple(notes)
        self.max_attempts = MAX_ATTEMPTS if max_attempts is None else max_attempts
        cls = validator_for(schema, default=jsonschema.Draft202012Validator)
        self.legacy_ref = cls.META_SCHEMA.get("$schema", "") in (
            "http://json-schema.org/draft-03/schema#",
            "http://json-schema.org/draft-04/schema#",
            "http://json-schema.org/draft-06/schema#",
            "http://json-schema.org/draft-07/schema#",
        )
        self.validator = cls(schema, format_checker=format_checker())
        self._unique = cls({"uniqueItems": True})
        self.pointers = {id(s): p for p, s in walk(schema)}
        self.modified = set(modified)
        self._subtree_memo: dict = {}
        self._nodes: dict = {}
        self._roots: dict = {}
        self._sub_validators: dict = {}
        self._results: dict = {}
        self._wanting: set = set()  # keys of _results whose value only lacks members (wanting())
        self.token_bytes = token_bytes
        self._has, self._first_number, self._last_number = _token_classes(token_bytes)

    # ------------------------------------------------------------------ schema locations
    def _resolve(self, ref: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        try:
            return self.validator._resolver.lookup(ref).contents
        except Exception:  # noqa: BLE001  (unresolvable here: no sub-value check below it; the final gate has it)
            return None

    def _expand(self, schemas) -> list:
        """Subschemas that certainly apply at the same instance location (closure over $ref, allOf, and an anyOf /
        oneOf of one subschema)."""
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
            todo.extend(s[k][0] for k in ("anyOf", "oneOf") if isinstance(s.get(k), list) and len(s[k]) == 1)
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

                if all(e.validator in _WANTING and not e.path for e in errors):
                    self._wanting.add(key)
                best = jsonschema.exceptions.best_match(errors)
                where = self.pointers.get(id(sub), "#")
                rel = "/".join(str(p) for p in best.schema_path)
                result = f"{best.validator!r} at {where}{'/' + rel if rel else ''}"
        if len(self._results) > 65536:
            self._results.clear()
            self._wanting = {key} & self._wanting
        self._results[key] = result
        return result

    def wanting(self, sub: dict, value_bytes: bytes) -> bool:
        """Whether the failure of the object `value_bytes` against `sub` (failure(), called first) is only that it
        lacks members (``required``, ``minProperties``, ``dependentRequired`` at the object itself): more members
        may fix it, as a grammar with keys in declaration order would make them come."""
        return (id(sub), value_bytes) in self._wanting

    def duplicate(self, items_bytes: bytes) -> bool:
        """Whether the JSON array text `items_bytes` has two equal items (jsonschema's uniqueItems equality)."""
        key = ("unique", items_bytes)
        if key not in self._results:
            try:
                self._results[key] = not self._unique.is_valid(json.loads(items_bytes))
            except ValueError:
                self._results[key] = False
        return self._results[key]


_CLASSES: dict = {}  # id(token_bytes) -> (token_bytes, classes): one vocabulary's classes, computed once


def _token_classes(token_bytes: list) -> tuple:
    """({"quote" | "key" | "close" | "any": [V] bool, tokens holding such a byte}, [V] starts a number, [V] ends one)
    for the look-ahead masks; cached per vocabulary (a tokenizer adapter's list), ~0.3 s for 49k tokens."""
    hit = _CLASSES.get(id(token_bytes))
    if hit is not None and hit[0] is token_bytes:
        return hit[1]
    lengths = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=len(token_bytes))
    has = {}
    for name, chars in (("quote", b'"'), ("key", b'",'), ("close", b'"]},' + b" \t\n\r"), ("any", None)):
        has[name] = np.array(
            [bool(t) and (chars is None or any(c in t for c in chars)) for t in token_bytes], dtype=bool
        ) & (lengths > 0)
    classes = (
        has,
        np.array([bool(t) and t[0] in _NUMBER_BYTES for t in token_bytes], dtype=bool),
        np.array([bool(t) and t[-1] in _NUMBER_BYTES for t in token_bytes], dtype=bool),
    )
    if len(_CLASSES) >= 4:
        _CLASSES.clear()
    _CLASSES[id(token_bytes)] = (token_bytes, classes)
    return classes


def check_schema(schema: dict) -> None:
    """GrammarError naming the place of the first error of `schema` against its meta-schema (formats included:
    a ``pattern`` must be a regex)."""
    import jsonschema
    from jsonschema.validators import validator_for

    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        error = jsonschema.exceptions.best_match(
            cls(cls.META_SCHEMA, format_checker=format_checker()).iter_errors(schema)
        )
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
        return SchemaChecks(
            schema,
            relaxed.modified,
            token_bytes,
            notes=relaxed.notes,
            frame=tuple(t.encode() for t in frame) if frame else None,
        )
    except Exception as err:  # noqa: BLE001  (jsonschema rejects the schema itself)
        raise GrammarError(f"json_schema: cannot be checked exactly ({type(err).__name__}: {err})") from None
