"""JSON Schema keywords the grammar backend refuses -> a sound over-approximation the backend compiles.

Every change widens the set of accepted instances (a dropped ``not``, ``if`` / ``then`` / ``else``, dependency,
``uniqueItems``, ``contains``, ``propertyNames``, an unknown ``format`` or an unparseable ``pattern``; ``oneOf``
compiled as ``anyOf``), so the grammar never masks a valid instance; what the grammar no longer enforces is checked
exactly by :mod:`.schema_checks` at the close of the sub-value it governs. ``modified`` holds the ``id()`` of every
subschema dict of the ORIGINAL schema whose own keywords were widened (the root's when the whole schema had to be
widened). A subschema that admits no value (``not: {}``) is compiled exactly, as an empty ``enum`` (llguidance; for
xgrammar, which refuses an empty enum, it is widened to any value and checked). Widening is per subschema: a backend
error about a reference is answered at that reference (schema_refs.py), one naming a subschema there only, so the
root's type, properties, required and additionalProperties stay in the grammar wherever the backend accepts them.

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

from .errors import GrammarError
from .schema_keys import any_order
from .schema_refs import INERT, check_refs, is_legacy, pointer_target, root_as_definition, sibling_nodes
from .schema_refs import strip_legacy_ref_siblings

logger = logging.getLogger(__name__)

# Keywords the llguidance backend refuses (1.9: "Unimplemented keys"); dropping any of them widens the schema.
DROP_KEYS = (
    "not",
    "if",
    "then",
    "else",
    "dependencies",
    "dependentSchemas",
    "dependentRequired",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
# Formats llguidance enforces itself (others are dropped from the grammar and checked here, or reported as unknown).
BACKEND_FORMATS = frozenset(
    ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri")
)
# Formats xgrammar 0.2.9 enforces (each replayed with a valid and an invalid string); others are widened.
XGRAMMAR_FORMATS = frozenset(
    (
        "date-time",
        "time",
        "date",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uuid",
        "uri",
        "uri-reference",
        "json-pointer",
    )
)
# Keys whose value is a map name -> subschema / a subschema / a list of subschemas.
MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
ONE_KEYS = (
    "items",
    "additionalProperties",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
LIST_KEYS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_XGRAMMAR_FEATURE = re.compile(r"JSON Schema feature '([^']+)'")
_CIRCULAR = re.compile(r"circular references with sibling keys are not supported: \S*?(#\S*)")
_MISSING_POINTER = re.compile(r"Pointer '([^']*)' does not exist")
_AT_PATH = re.compile(r"json-schema:///(#/\S*)|while processing \S*?(#/\S*)")
MAX_ROUNDS = 40
SKELETON_DEPTHS = (4, 2, 1)  # last fallbacks: subschemas deeper than this (and references) widened to any value


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

    def __init__(self, original: dict, known_formats, backend: str = "llguidance", property_order: str = "schema"):
        self.original = original
        self.any_order = property_order == "any" and backend == "llguidance"
        self.known_formats = known_formats
        self.xgrammar = backend == "xgrammar"
        self.backend_formats = XGRAMMAR_FORMATS if self.xgrammar else BACKEND_FORMATS
        self.drop = set(DROP_KEYS)
        self.formats_dropped: set = set()
        self.drop_patterns = False
        self.legacy = is_legacy(original)  # keywords beside a $ref are ignored (drafts 03-07): dropped, exactly
        self.root_def = False  # references to "#" point at a copy of the root (schema_refs.root_as_definition)
        self.strip_at: set = set()  # paths whose keywords beside a $ref (or an anyOf / oneOf / allOf) are dropped
        self.any_at: set = set()  # paths of subschemas widened to any value
        self.skeleton: int | None = None  # depth below which every subschema (and every $ref) is any value
        self.last: dict = {}

    def build(self, out: Relaxed) -> dict:
        relaxed = copy.deepcopy(self.original)
        originals = dict(walk(self.original))
        unknown: dict = {}  # format -> paths: one note for the schema
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
                    unknown.setdefault(fmt, []).append(path)
            elif isinstance(fmt, str) and orig is not None:  # the backend's format regexes are close, not exact
                out.modified.add(id(orig))  # (2023-02-29 passes as a date): checked at the close as well
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
        if unknown:
            out.notes[:] = [
                "formats that are not known, any string accepted: "
                + "; ".join(
                    f"{fmt!r} at {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}"
                    for fmt, paths in unknown.items()
                )
            ]
        self._structure(relaxed, originals, out)
        self.last = relaxed
        return relaxed

    def _structure(self, relaxed: dict, originals: dict, out: Relaxed) -> None:
        """The widenings at one place each (a reference's siblings, a subschema named by an error, the skeleton),
        then the exact reference rewrites (schema_refs.py)."""

        def mark(path, key):
            if path in originals:
                out.modified.add(id(originals[path]))
                out.dropped.setdefault(key, []).append(path)

        if self.legacy:
            strip_legacy_ref_siblings([sub for _, sub in walk(relaxed)])
        nodes = dict(walk(relaxed))
        for path in sorted(self.strip_at):
            sub = nodes.get(path)
            if sub is None:
                continue
            keep = INERT if "$ref" in sub else INERT | {"anyOf", "oneOf", "allOf"}
            if any(k not in keep for k in sub):
                for key in [k for k in sub if k not in keep]:
                    del sub[key]
                mark(path, "sibling keywords")
        for path in sorted(self.any_at, key=len):
            sub = nodes.get(path)
            if sub is not None:
                _to_any(sub, lambda: mark(path, "subschema"))
        if self.skeleton is not None:
            for path, sub in list(walk(relaxed)):
                if "$ref" in sub or path.count("/") > 2 * self.skeleton:  # "#/properties/a/items": depth 2
                    _to_any(sub, lambda: mark(path, "subschema"))
        if self.any_order:  # last: it moves subschemas (their paths change)
            for path, sub in list(walk(relaxed)):
                changed = []
                any_order(sub, changed)
                for key in changed:
                    mark(path, key)
        if self.root_def:
            root_as_definition(relaxed, [sub for _, sub in walk(relaxed)])

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
            if (
                len(keys) == len(parts)
                and sum(map(len, keys)) == len(set().union(*keys))
                and not set().union(*keys) & {"$ref", "additionalItems", "allOf"}
            ):
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
        return self._widen_at_reference(message)

    def _widen_at_reference(self, message: str) -> bool:
        """A reference the backend refuses: the exact rewrite first, else widened at the place the error names."""
        m = _CIRCULAR.search(message)
        if m:
            target = m.group(1)
            if not self.root_def and any(s.get("$ref") in ("#", "#/") for _, s in walk(self.last)):
                self.root_def = True
                return True
            nodes = sibling_nodes(self.last, walk(self.last), target)
            # in turn: the siblings beside a reference; the references to the target, each widened at its place;
            # the siblings beside an anyOf / oneOf / allOf holding such a reference
            refs = {p for p, s in walk(self.last) if s.get("$ref") == target}
            for found, into in (
                ({p for p, s in nodes if "$ref" in s}, self.strip_at),
                (refs, self.any_at),
                ({p for p, s in nodes if "$ref" not in s}, self.strip_at),
            ):
                found = {self._original_path(p) for p in found} - ({"#"} if into is self.any_at else set())
                if found - into:
                    into |= found
                    return True
            return self._widen_path(self._original_path(target))
        m = _MISSING_POINTER.search(message)
        if m:
            ref = "#" + m.group(1)
            found = {self._original_path(p) for p, s in walk(self.last) if str(s.get("$ref", "")).endswith(ref)}
            if found - self.any_at:
                self.any_at |= found
                return True
        m = _AT_PATH.search(message)
        if m:
            return self._widen_path(self._original_path(m.group(1) or m.group(2)))
        return False

    def _widen_path(self, path: str) -> bool:
        if path in self.any_at or path == "#":
            return False
        try:
            pointer_target(self.original, path)
        except (KeyError, IndexError, ValueError, TypeError):
            return False
        self.any_at.add(path)
        return True

    @staticmethod
    def _original_path(path: str) -> str:
        """A path inside the root's copy (root_as_definition) -> the same place in the original schema."""
        for box in ("$defs", "definitions"):
            prefix = f"#/{box}/__root__"
            if path == prefix or path.startswith(prefix + "/"):
                return "#" + path[len(prefix) :]
        return path


def _to_any(sub: dict, marked) -> None:
    """`sub` (in place) admits any value: every keyword but the definitions it holds goes; marked() if it changed."""
    keys = [k for k in sub if k not in ("definitions", "$defs")]
    if any(k not in INERT or k == "$ref" for k in keys):
        for key in keys:
            del sub[key]
        marked()


def relax_and_compile(
    schema: dict, compile_fn, known_formats, backend: str = "llguidance", property_order: str = "schema"
) -> tuple[object, Relaxed]:
    """compile_fn(schema dict, extra backend options) -> compiled (raises GrammarError). Widen until it compiles.

    Order: the keywords the backend is known to refuse; then what each error names (keywords, formats, regexes, a
    reference: rewritten exactly, else widened there only, or a subschema: widened there only); then the backend's
    lenient mode; then skeletons of the schema (the root's type, properties, required and additionalProperties kept,
    deeper subschemas any value); last, the whole schema as any JSON value (everything checked exactly).
    Returns (compiled, Relaxed).
    """
    check_refs(schema, walk(schema))
    out = Relaxed(schema)
    relaxer = _Relaxer(schema, known_formats, backend, property_order)
    options = {"coerce_one_of": True}

    def attempt(rounds: int):
        nonlocal last
        for _ in range(rounds):
            out.modified, out.dropped = set(), {}
            relaxed = relaxer.build(out)
            try:
                compiled = compile_fn(relaxed, options)
            except GrammarError as err:
                last = str(err)
                if "Unsatisfiable schema" in last and relaxer.any_order:  # keys in any order: not said here
                    relaxer.any_order = False
                    continue
                if "Unsatisfiable schema" in last:  # the widened schema admits no value: neither does the schema
                    raise GrammarError(f"json_schema: the schema admits no value ({last})") from None
                if relaxer.widen_from_error(last):
                    continue
                return None
            out.schema, out.options = relaxed, options
            return compiled
        return None

    last = None
    compiled = attempt(MAX_ROUNDS)
    if compiled is not None:
        return compiled, out
    logger.info("schema still refused after widening (%s); trying the lenient mode", last)
    try:
        compiled = compile_fn(relaxer.last, {**options, "lenient": True})
    except GrammarError as err:
        last = str(err)
    else:
        out.schema, out.options, out.whole = relaxer.last, {**options, "lenient": True}, True
        out.modified.add(id(schema))
        out.dropped.setdefault("lenient", []).append("#")
        return compiled, out
    for depth in SKELETON_DEPTHS:
        relaxer.skeleton = depth
        compiled = attempt(8)
        if compiled is not None:
            logger.info("schema widened below depth %d (%s)", depth, last)
            return compiled, out
    try:
        compiled = compile_fn({}, {})
    except GrammarError as err:
        raise GrammarError(f"json_schema: {err}") from None
    out.schema, out.options, out.whole = {}, {}, True
    out.modified = {id(schema)}
    out.dropped.setdefault("*", []).append("#")
    return compiled, out
