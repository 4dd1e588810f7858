"""JSON Schema keywords the grammar backend refuses -> a sound over-approximation the backend compiles.

Every change widens the set of accepted instances (a dropped ``not``, ``if`` / ``then`` / ``else``, dependency,
``uniqueItems``, ``contains``, ``propertyNames``, an unknown ``format`` or an unparseable ``pattern``; ``oneOf``
compiled as ``anyOf``), so the grammar never masks a valid instance; what the grammar no longer enforces is checked
exactly by :mod:`.schema_checks` at the close of the sub-value it governs. ``modified`` holds the ``id()`` of every
subschema dict of the ORIGINAL schema whose own keywords were widened (the root's when the whole schema had to be
widened). A subschema that admits no value (``not: {}``) is compiled exactly, as an empty ``enum`` (llguidance; for
xgrammar, which refuses an empty enum, it is widened to any value and checked).

Per backend (``relax_and_compile(..., backend=)``): llguidance refuses the keywords of DROP_KEYS and formats outside
BACKEND_FORMATS. xgrammar 0.2.9 compiles more without error but does not enforce it, or wrongly narrows it (found by
replaying valid and invalid instances): the same DROP_KEYS, ``oneOf`` (rewritten as ``anyOf``), ``allOf`` of several
subschemas (merged into one when their keywords are disjoint, else only the first kept), ``multipleOf`` with a
non-integer, ``minLength`` / ``maxLength`` beside a ``pattern``, ``patternProperties``, ``enum`` / ``const`` with an
object or array value, an empty ``enum``, and formats outside XGRAMMAR_FORMATS.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass, field
from urllib.parse import unquote

from .errors import GrammarError

logger = logging.getLogger(__name__)

# Keywords the llguidance backend refuses (1.9: "Unimplemented keys"); dropping any of them widens the schema.
DROP_KEYS = ("not", "if", "then", "else", "dependencies", "dependentSchemas", "dependentRequired", "uniqueItems",
             "contains", "minContains", "maxContains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
# Formats llguidance enforces itself (others are dropped from the grammar and checked here, or reported as unknown).
BACKEND_FORMATS = frozenset(("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                             "uri"))
# Formats xgrammar 0.2.9 enforces (each replayed with a valid and an invalid string); others are widened.
XGRAMMAR_FORMATS = frozenset(("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                              "uri", "uri-reference", "json-pointer"))
# Keys whose value is a map name -> subschema / a subschema / a list of subschemas.
MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
ONE_KEYS = ("items", "additionalProperties", "propertyNames", "not", "if", "then", "else", "contains",
            "unevaluatedProperties", "unevaluatedItems", "additionalItems")
LIST_KEYS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_XGRAMMAR_FEATURE = re.compile(r"JSON Schema feature '([^']+)'")


@dataclass
class Relaxed:
    """schema: what the backend compiles; modified: ids of original subschemas widened; notes: user-facing remarks
    (unknown formats); dropped: {keyword: [schema paths]}; whole: the whole schema was widened to any JSON."""

    schema: dict
    modified: set = field(default_factory=set)
    notes: list = field(default_factory=list)
    dropped: dict = field(default_factory=dict)
    whole: bool = False
    options: dict = field(default_factory=dict)


def walk(schema, path="#"):
    """Yield (json-pointer path, subschema dict) for every subschema dict of `schema` (definitions included)."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in MAP_KEYS + ("dependencies",):
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, s in sub.items():
                yield from walk(s, f"{path}/{key}/{_escape(name)}")
    for key in ONE_KEYS:
        if isinstance(schema.get(key), dict):
            yield from walk(schema[key], f"{path}/{key}")
    for key in LIST_KEYS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                yield from walk(s, f"{path}/{key}/{i}")


def _escape(name) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


class _Relaxer:
    """Builds a widened copy of the original schema; records which original subschemas it widened."""

    def __init__(self, original: dict, known_formats, backend: str = "llguidance"):
        self.original = original
        self.known_formats = known_formats
        self.xgrammar = backend == "xgrammar"
        self.backend_formats = XGRAMMAR_FORMATS if self.xgrammar else BACKEND_FORMATS
        self.drop = set(DROP_KEYS)
        self.formats_dropped: set = set()
        self.drop_patterns = False

    def build(self, out: Relaxed) -> dict:
        relaxed = copy.deepcopy(self.original)
        originals = dict(walk(self.original))
        for path, sub in walk(relaxed):
            orig = originals.get(path)
            changed = []
            if sub.get("not") in ({}, True):  # admits no value: said exactly (llguidance knows an empty enum)
                sub.clear()
                if not self.xgrammar:
                    sub["enum"] = []
                    continue
                changed.append("not")  # xgrammar refuses an empty enum: any value, checked
            if self.xgrammar:
                self._xgrammar(sub, changed)
            for key in list(sub):
                if key in self.drop and not (key == "uniqueItems" and sub[key] is False):
                    changed.append(key)
                    del sub[key]
                elif key in self.drop:
                    del sub[key]
            if "oneOf" in sub:  # compiled as anyOf (coerce_one_of): exclusivity is checked
                changed.append("oneOf")
            fmt = sub.get("format")
            if isinstance(fmt, str) and (fmt not in self.backend_formats or fmt in self.formats_dropped):
                del sub["format"]
                changed.append("format")
                if fmt not in self.known_formats:
                    note = f"format {fmt!r} at {path} is not a known format: any string is accepted"
                    if note not in out.notes:
                        out.notes.append(note)
            mult = sub.get("multipleOf")
            if isinstance(mult, float) and not mult.is_integer():
                del sub["multipleOf"]  # llguidance 1.9 rejects valid multiples of non-integers (0.5 for 0.25)
                changed.append("multipleOf")
            if self.drop_patterns and "pattern" in sub:
                del sub["pattern"]
                changed.append("pattern")
            if self.drop_patterns and isinstance(sub.get("patternProperties"), dict):
                del sub["patternProperties"]  # dropping it alone would narrow additionalProperties: drop both
                sub.pop("additionalProperties", None)
                changed.append("patternProperties")
            # llguidance: min / maxProperties only with every property required
            if not self.xgrammar and ("minProperties" in sub or "maxProperties" in sub):
                props = sub.get("properties") if isinstance(sub.get("properties"), dict) else {}
                required = set(sub.get("required") or []) if isinstance(sub.get("required"), list) else set()
                if not set(props) <= required or sub.get("additionalProperties", True) is not False:
                    for key in ("minProperties", "maxProperties"):
                        if key in sub:
                            del sub[key]
                            changed.append(key)
            if changed and orig is not None:
                out.modified.add(id(orig))
                for key in changed:
                    out.dropped.setdefault(key, []).append(path)
        return relaxed

    @staticmethod
    def _xgrammar(sub: dict, changed: list) -> None:
        """Keywords xgrammar compiles but does not enforce, or narrows (module docstring): widened in place."""
        if isinstance(sub.get("oneOf"), list):  # as anyOf (beside an anyOf: dropped, wider still)
            one = sub.pop("oneOf")
            sub.setdefault("anyOf", one)
            changed.append("oneOf")
        parts = sub.get("allOf")
        if isinstance(parts, list) and len(parts) > 1:
            keys = [set(p) for p in parts if isinstance(p, dict)]
            if (len(keys) == len(parts) and sum(map(len, keys)) == len(set().union(*keys))
                    and not set().union(*keys) & {"$ref", "additionalItems", "allOf"}):
                sub["allOf"] = [{k: v for p in parts for k, v in p.items()}]  # disjoint keywords: one subschema
            else:
                sub["allOf"] = parts[:1]  # its first subschema: a superset
            changed.append("allOf")
        if "pattern" in sub:
            for key in ("minLength", "maxLength"):
                if key in sub:
                    del sub[key]
                    changed.append(key)
        if "patternProperties" in sub:
            del sub["patternProperties"]  # dropping it alone would narrow additionalProperties: drop both
            sub.pop("additionalProperties", None)
            changed.append("patternProperties")
        if sub.get("enum") == []:  # refused by xgrammar: any value, checked (the check fails every value)
            del sub["enum"]
            changed.append("enum")
        for key in ("enum", "const"):
            values = sub.get(key) if key == "enum" else [sub.get(key)]
            if key in sub and isinstance(values, list) and any(isinstance(v, (dict, list)) for v in values):
                del sub[key]
                changed.append(key)

    def widen_from_error(self, message: str) -> bool:
        """Widen further after a backend error; False if the message names nothing more to widen."""
        m = _UNIMPLEMENTED.search(message)
        if m:
            keys = set(json.loads("[" + m.group(1) + "]")) - self.drop
            if keys:
                self.drop |= keys
                return True
        m = _XGRAMMAR_FEATURE.search(message)
        if m and m.group(1) not in self.drop:
            self.drop.add(m.group(1))
            return True
        m = _UNKNOWN_FORMAT.search(message)
        if m and m.group(1).strip("\"'") not in self.formats_dropped:
            self.formats_dropped.add(m.group(1).strip("\"'"))
            return True
        if "regex" in message.lower() and not self.drop_patterns:
            self.drop_patterns = True
            return True
        return False


def _pointer_target(root, ref: str):
    """The subschema a local JSON-pointer ref ("#", "#/a/b") names, or raises KeyError / IndexError."""
    node = root
    for part in ref[2:].split("/") if ref not in ("#", "#/") else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def check_refs(schema: dict) -> None:
    """GrammarError naming the path of the first local ``$ref`` (``#/...``) that names nothing in the schema."""
    for path, sub in walk(schema):
        ref = sub.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            try:
                _pointer_target(schema, ref)
            except (KeyError, IndexError, ValueError, TypeError):
                raise GrammarError(f"json_schema: '$ref' at {path}: {ref!r} names nothing in the schema") from None


def relax_and_compile(schema: dict, compile_fn, known_formats, backend: str = "llguidance") -> tuple[object, Relaxed]:
    """compile_fn(schema dict, extra backend options) -> compiled (raises GrammarError). Widen until it compiles.

    Order: the keywords the backend is known to refuse; then what each error names (keywords, formats, regexes);
    then the backend's lenient mode; last, the whole schema as any JSON value (everything checked exactly).
    Returns (compiled, Relaxed).
    """
    check_refs(schema)
    out = Relaxed(schema)
    relaxer = _Relaxer(schema, known_formats, backend)
    options = {"coerce_one_of": True}
    last = None
    for _ in range(12):
        out.modified, out.dropped = set(), {}
        relaxed = relaxer.build(out)
        try:
            compiled = compile_fn(relaxed, options)
        except GrammarError as err:
            last = str(err)
            if "Unsatisfiable schema" in last:  # the widened schema admits no value: neither does the schema
                raise GrammarError(f"json_schema: the schema admits no value ({last})") from None
            if relaxer.widen_from_error(last):
                continue
            break
        out.schema, out.options = relaxed, options
        return compiled, out
    logger.info("schema still refused after widening (%s); trying the lenient mode", last)
    for attempt, (candidate, opts) in enumerate(((relaxed, {**options, "lenient": True}), ({}, {}))):
        try:
            compiled = compile_fn(candidate, opts)
        except GrammarError as err:
            last = str(err)
            continue
        out.schema, out.options, out.whole = candidate, opts, True
        out.modified.add(id(schema))
        out.dropped.setdefault("lenient" if attempt == 0 else "*", []).append("#")
        return compiled, out
    raise GrammarError(f"json_schema: {last}")
