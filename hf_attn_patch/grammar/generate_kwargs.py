"""generate() keywords -> a grammar LogitsProcessor: OpenAI-style ``response_format`` and a ``grammar=`` keyword.

response_format (OpenAI shape), or a list with one per input row:
    {"type": "text"}                                             unconstrained (all rows text -> no processor)
    {"type": "json_object"}                                      any JSON object
    {"type": "json_schema", "json_schema": {"schema": {...}, "name": "...", "strict": true}}
        with "property_order": "any" (default) | "schema" (GrammarSpec)
grammar, or a list with one per input row:
    "start: ..." / "root ::= ..."                                Lark or GBNF text (auto-detected by ``::=``)
    {"type": "regex", "pattern": "..."}                          full match
    {"type": "lark", "grammar": "..."} / {"type": "gbnf", "grammar": "..."}   ("ebnf" = "gbnf")
    {"type": "choice", "choices": ["yes", "no"]}                 exactly one of the strings
    {"type": "json_schema", "schema": {...}}                     same as response_format json_schema
    {"type": "tagged_json", "schema": {...}, "open": "<tool_call>", "close": "</tool_call>"}
                                                                 text not starting with open's first character, or
                                                                 open + JSON of the schema + close (a tool call)
In a per-row list, a "text" row is constrained only to text (special tokens other than EOS are masked).
"""

from __future__ import annotations

from .errors import GrammarError
from .processors import GrammarConstrainedLogitsProcessor, grammar_spec
from .spec import DEFAULT_PROPERTY_ORDER, PROPERTY_ORDERS, GrammarSpec

_ANY_TEXT = "(?s:.*)"


def _response_format_spec(rf, field: str) -> GrammarSpec | None:
    if not isinstance(rf, dict):
        raise ValueError(f"{field}: expected a dict like {{'type': 'json_schema', ...}}, got {rf!r:.100}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError(f"{field}['json_schema']: expected a dict with a 'schema' key, got {js!r:.100}")
        schema = js.get("schema")
        if schema is None:
            raise ValueError(f"{field}['json_schema']['schema']: missing (keys present: {sorted(js)})")
        order = js.get("property_order", DEFAULT_PROPERTY_ORDER)
        if order not in PROPERTY_ORDERS:
            raise ValueError(
                f"{field}['json_schema']['property_order']: expected one of {PROPERTY_ORDERS}, got {order!r}"
            )
        try:
            return GrammarSpec.json_schema(schema, order)
        except GrammarError as err:
            raise GrammarError(f"{field}['json_schema']['schema']: {err}") from None
    raise ValueError(f"{field}['type']: expected 'text', 'json_object' or 'json_schema', got {kind!r}")


def _grammar_spec(g, field: str) -> GrammarSpec | None:
    if isinstance(g, str):
        return grammar_spec(g)
    if not isinstance(g, dict):
        raise ValueError(
            f"{field}: expected grammar text or a dict like {{'type': 'regex', 'pattern': ...}}, got {g!r:.100}"
        )
    kind = g.get("type")
    needs = {
        "regex": "pattern",
        "lark": "grammar",
        "gbnf": "grammar",
        "ebnf": "grammar",
        "choice": "choices",
        "json_schema": "schema",
        "tagged_json": "schema",
    }
    if kind == "text":
        return None
    if kind not in needs:
        raise ValueError(f"{field}['type']: expected one of {sorted(needs) + ['text']}, got {kind!r}")
    key = needs[kind]
    if key not in g:
        raise ValueError(f"{field}['{key}']: missing for type {kind!r}")
    value = g[key]
    try:
        if kind == "regex":
            return GrammarSpec.regex(value)
        if kind == "choice":
            return GrammarSpec.choice(value)
        if kind == "json_schema":
            return GrammarSpec.json_schema(value, g.get("property_order", DEFAULT_PROPERTY_ORDER))
        if kind == "tagged_json":
            return GrammarSpec.tagged_json(
                value, g.get("open"), g.get("close"), g.get("property_order", DEFAULT_PROPERTY_ORDER)
            )
        return grammar_spec(value, "lark" if kind == "lark" else "gbnf")
    except GrammarError as err:
        raise GrammarError(f"{field}['{key}']: {err}") from None


def processor_from_generate_kwargs(
    *, response_format=None, grammar=None, tokenizer=None, backend: str = "auto", eos_token_id=None
) -> GrammarConstrainedLogitsProcessor | None:
    """The LogitsProcessor for generate(response_format=..., grammar=..., tokenizer=...), or None if unconstrained.

    response_format / grammar: see the module docstring (mutually exclusive; each may be a list, one per input row).
    tokenizer: the model's tokenizer (required when constrained). backend: "auto" | "llguidance" | "xgrammar".
    eos_token_id: int or list (default: the tokenizer's); pass the generation config's EOS ids when they differ.
    Raises ValueError (GrammarError for an unsupported grammar feature) naming the bad field and value.
    """
    if response_format is not None and grammar is not None:
        raise ValueError("response_format and grammar: pass one of them, not both")
    if response_format is None and grammar is None:
        return None
    name, value, one = (
        ("response_format", response_format, _response_format_spec)
        if response_format is not None
        else ("grammar", grammar, _grammar_spec)
    )
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{name}: expected a non-empty list (one entry per input row), got []")
        specs = [one(v, f"{name}[{i}]") for i, v in enumerate(value)]
    else:
        specs = [one(value, name)]
    if all(s is None for s in specs):
        return None
    if tokenizer is None:
        raise ValueError(f"tokenizer: required with {name}= (pass tokenizer=<the model's tokenizer>)")
    specs = [GrammarSpec.regex(_ANY_TEXT) if s is None else s for s in specs]
    return GrammarConstrainedLogitsProcessor(specs, tokenizer, backend=backend, eos_token_id=eos_token_id)
