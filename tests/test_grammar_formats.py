"""Formats real schemas use are checked exactly (jsonschema's checkers and the packages they use, plus OpenAPI's),
and an unknown format warns once per schema."""

from __future__ import annotations

import json
import logging

import pytest

from hf_attn_patch.grammar import GrammarSpec, compile_grammar

from .test_grammar_schemas import _replay

# format -> (valid values, invalid values); strings unless numbers (OpenAPI's number formats)
FORMATS = {
    "uri-template": (["http://x.org/{id}", "/a{?q,r}"], ["http://x.org/{id", "/a}b{"]),
    "int32": ([2147483647, -2147483648], [2147483648, 1.5]),
    "int64": ([9223372036854775807], [9223372036854775808]),
    "float": ([1.5, 3.0e38], [3.5e38]),
    "double": ([1.0e308], [1.0e999]),
    "byte": (["YWJj", "YQ==", ""], ["abc", "YQ="]),
    "binary": (["any text"], []),
    "password": (["hunter2"], []),
    "duration": (["P1D", "PT5M"], ["P", "1D"]),
    "hostname": (["example.com"], ["a..b", "-x.com"]),
    "uri": (["https://example.com/a?b=c"], ["no scheme", "http://a b"]),
    "date": (["2024-02-29"], ["2023-02-29"]),
    "ipv4": (["10.0.0.1"], ["10.0.0.256"]),
    "json-pointer": (["/a/b"], ["a/b"]),
    "regex": (["a+"], ["("]),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_checked_exactly(stories, fmt):
    valid, invalid = FORMATS[fmt]
    numeric = not isinstance((valid + invalid)[0], str)
    schema = {"type": "number" if numeric else "string", "format": fmt}
    grammar = compile_grammar(GrammarSpec.json_schema(schema), stories[1])
    assert not grammar.notes, grammar.notes  # a known format
    for v in valid:
        assert _replay(grammar, json.dumps(v) if v != 1.0e999 else "1e999"), (fmt, v)
    for v in invalid:
        text = "1e999" if v == 1.0e999 else json.dumps(v)
        assert not _replay(grammar, text), (fmt, v)


def test_unknown_format_warns_once_per_schema(stories, caplog):
    schema = {
        "type": "object",
        "properties": {k: {"type": "string", "format": "country-code", "maxLength": 3} for k in ("a", "b", "c")},
    }
    with caplog.at_level(logging.WARNING, logger="hf_attn_patch.grammar"):
        grammar = compile_grammar(GrammarSpec.json_schema(schema), stories[1], cache=False)
    warned = [r for r in caplog.records if "country-code" in r.getMessage()]
    assert len(warned) == 1 and len(grammar.notes) == 1, (warned, grammar.notes)
    assert "#/properties/a" in grammar.notes[0] and "#/properties/c" in grammar.notes[0]
    assert _replay(grammar, json.dumps({"a": "?!", "b": "xy"}))
