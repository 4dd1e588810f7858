"""``$ref`` rewrites for the grammar side of a schema (schema_relax.py), so that a backend error about one reference
widens that reference only, never the whole document.

- :func:`strip_legacy_ref_siblings`: in drafts 03-07 the keywords beside a ``$ref`` are ignored by the spec;
  llguidance intersects them (2020-12 semantics), which narrows the schema and, on a recursive reference, fails with
  "circular references with sibling keys". Dropping them is exact.
- :func:`root_as_definition`: a ``$ref`` to ``#`` (the whole document) recursing through subschemas with sibling
  keywords fails the same way; pointing those references at a copy of the root kept under the definitions is exact.
- :func:`sibling_nodes`: the subschemas whose sibling keywords a backend intersects with a reference on a cycle
  through a given target (the place to widen when the exact rewrites are not enough).
"""

from __future__ import annotations

from urllib.parse import unquote

from .errors import GrammarError

# Keywords that constrain nothing (annotations) or only hold subschemas for references: kept beside a $ref.
INERT = frozenset(
    (
        "$ref",
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "definitions",
        "$defs",
        "id",
        "$id",
        "$schema",
        "deprecated",
        "readOnly",
        "writeOnly",
        "example",
    )
)
LEGACY_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")
ROOT_COPY = "__root__"
_APPLICATORS = ("anyOf", "oneOf", "allOf")


def is_legacy(schema: dict) -> bool:
    """Whether the schema declares a draft (03-07) in which keywords beside a ``$ref`` are ignored."""
    return any(d in str(schema.get("$schema", "")) for d in LEGACY_DRAFTS)


def strip_legacy_ref_siblings(nodes) -> None:
    """Drop the constraining keywords beside every ``$ref`` of `nodes` (dicts of a legacy-draft schema), in place."""
    for sub in nodes:
        if isinstance(sub.get("$ref"), str):
            for key in [k for k in sub if k not in INERT]:
                del sub[key]


def pointer_target(root, ref: str):
    """The subschema a local JSON-pointer ref ("#", "#/a/b") names, or raises KeyError / IndexError / ValueError."""
    node = root
    for part in ref[2:].split("/") if ref not in ("#", "#/") else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def root_as_definition(schema: dict, nodes) -> bool:
    """Move the root's keywords into a definition, the root a ``$ref`` to it, and point every ``{"$ref": "#"}``
    among `nodes` (the dicts of `schema`) there too; in place. False (nothing done) when no such reference exists or
    the root sets an ``$id``."""
    refs = [s for s in nodes if s.get("$ref") in ("#", "#/") and s is not schema]
    if not refs or "$id" in schema or "id" in schema:
        return False
    box = "$defs" if isinstance(schema.get("$defs"), dict) or "definitions" not in schema else "definitions"
    if not isinstance(schema.get(box), dict):
        schema[box] = {}
    body = {k: v for k, v in schema.items() if k not in ("definitions", "$defs", "$schema")}
    for key in body:
        del schema[key]
    schema[box][ROOT_COPY] = body
    schema["$ref"] = f"#/{box}/{ROOT_COPY}"
    for s in refs:
        s["$ref"] = f"#/{box}/{ROOT_COPY}"
    return True


def _dicts(value):
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _dicts(v)
    elif isinstance(value, list):
        for v in value:
            yield from _dicts(v)


def _refs_in(value) -> set:
    return {s["$ref"] for s in _dicts(value) if isinstance(s.get("$ref"), str) and s["$ref"].startswith("#")}


def reach(schema: dict, ref: str, memo: dict) -> set:
    """Local references reachable from `ref` (its target's subtree, then theirs, transitively)."""
    if ref in memo:
        return memo[ref]
    memo[ref] = seen = set()
    todo = [ref]
    while todo:
        r = todo.pop()
        try:
            target = pointer_target(schema, r)
        except (KeyError, IndexError, ValueError, TypeError):
            continue
        for nxt in (
            _refs_in(target)
            if r not in ("#", "#/")
            else _refs_in({k: v for k, v in target.items() if k not in ("definitions", "$defs")})
        ):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def sibling_nodes(schema: dict, walked, target: str) -> list:
    """(path, node) of the subschemas that intersect constraining keywords with a reference that reaches the
    reference `target` (a pointer like "#/definitions/a"): a ``$ref`` with siblings, or siblings beside an
    ``anyOf`` / ``oneOf`` / ``allOf`` holding such a ``$ref``."""
    memo: dict = {}
    out = []
    for path, sub in walked:
        if not any(k not in INERT and k not in _APPLICATORS for k in sub):
            continue
        refs = [sub["$ref"]] if isinstance(sub.get("$ref"), str) else []
        for key in _APPLICATORS:
            if isinstance(sub.get(key), list):
                refs += [b["$ref"] for b in sub[key] if isinstance(b, dict) and isinstance(b.get("$ref"), str)]
        if any(r == target or target in reach(schema, r, memo) for r in refs):
            out.append((path, sub))
    return out


def check_refs(schema: dict, walked) -> None:
    """GrammarError naming the path of the first local ``$ref`` (``#/...``) among `walked` ((path, subschema) of
    `schema`) that names nothing in the schema."""
    for path, sub in walked:
        ref = sub.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            try:
                pointer_target(schema, ref)
            except (KeyError, IndexError, ValueError, TypeError):
                raise GrammarError(f"json_schema: '$ref' at {path}: {ref!r} names nothing in the schema") from None
