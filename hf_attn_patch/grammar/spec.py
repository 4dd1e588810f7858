"""What a row must follow: a small, validated description of a grammar, independent of the backend."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import GrammarError


PROPERTY_ORDERS = ("schema", "any")
DEFAULT_PROPERTY_ORDER = "any"  # keys in any order (up to schema_keys.ANY_ORDER_MAX_PROPERTIES per object)


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint.

    kind: one of ``json_schema`` (source: a JSON Schema dict or JSON text), ``json_object`` (any JSON object; source
    ignored), ``regex`` (source: pattern, full match), ``lark`` (Lark text with a ``start`` rule), ``gbnf``
    (GBNF / EBNF text with a ``root`` rule), ``choice`` (source: a tuple of strings; the output is exactly one),
    ``tagged_json`` (source: (schema dict, open, close); the output is either text that does not start with the
    first character of ``open``, or ``open`` + JSON valid under the schema + ``close``: a tool call or an answer).
    key: a canonical string used to cache compiled grammars (two equal specs share one compilation).
    property_order (json_schema): "any" (the default: an object's keys in any order, required keys and no repeated
    key checked exactly; objects with more than 64 properties keep their declaration order, schema_keys.py) or
    "schema" (keys in the order ``properties`` lists them everywhere, required ones enforced by the grammar).
    """

    kind: str
    source: Any = None
    key: str = field(default="", compare=False)
    property_order: str = DEFAULT_PROPERTY_ORDER

    @staticmethod
    def json_schema(schema, property_order: str = DEFAULT_PROPERTY_ORDER) -> "GrammarSpec":
        if property_order not in PROPERTY_ORDERS:
            raise GrammarError(f"property_order: expected one of {PROPERTY_ORDERS}, got {property_order!r}")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise GrammarError(f"schema: not valid JSON ({err})") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise GrammarError(f"schema: expected a JSON Schema dict, got {type(schema).__name__}: {schema!r:.80}")
        try:
            key = json.dumps(schema, sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError) as err:
            raise GrammarError(f"schema: not JSON-serialisable ({err})") from None
        return GrammarSpec("json_schema", schema, f"json_schema:{property_order}:" + key, property_order)

    @staticmethod
    def tagged_json(
        schema, open_tag: str, close_tag: str, property_order: str = DEFAULT_PROPERTY_ORDER
    ) -> "GrammarSpec":
        inner = GrammarSpec.json_schema(schema, property_order)
        for name, tag in (("open", open_tag), ("close", close_tag)):
            if not isinstance(tag, str) or not tag or '"' in tag or "\\" in tag:
                raise GrammarError(f"{name}: expected a non-empty tag without quotes or backslashes, got {tag!r:.80}")
        return GrammarSpec(
            "tagged_json",
            (inner.source, open_tag, close_tag),
            f"tagged_json:{open_tag}\0{close_tag}\0{inner.key}",
            property_order,
        )

    @staticmethod
    def json_object() -> "GrammarSpec":
        return GrammarSpec("json_object", None, "json_object")

    @staticmethod
    def regex(pattern: str) -> "GrammarSpec":
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"pattern: expected a non-empty regex string, got {pattern!r:.80}")
        return GrammarSpec("regex", pattern, "regex:" + pattern)

    @staticmethod
    def lark(text: str) -> "GrammarSpec":
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"grammar: expected non-empty Lark text, got {text!r:.80}")
        return GrammarSpec("lark", text, "lark:" + text)

    @staticmethod
    def gbnf(text: str) -> "GrammarSpec":
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"grammar: expected non-empty GBNF text, got {text!r:.80}")
        return GrammarSpec("gbnf", text, "gbnf:" + text)

    @staticmethod
    def choice(options) -> "GrammarSpec":
        if isinstance(options, str) or not hasattr(options, "__iter__"):
            raise GrammarError(f"choices: expected a list of strings, got {options!r:.80}")
        options = tuple(options)
        if not options:
            raise GrammarError("choices: expected at least one string, got an empty list")
        bad = [o for o in options if not isinstance(o, str) or not o]
        if bad:
            raise GrammarError(f"choices: every choice must be a non-empty string, got {bad[0]!r:.80}")
        return GrammarSpec("choice", options, "choice:" + json.dumps(options, ensure_ascii=False))
