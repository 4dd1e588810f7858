"""Keys in any order (property_order="any", the default): an object's keys in another order than its ``properties``
list them are allowed; a missing required key, a repeated key and an unknown key are not. Objects with more than
ANY_ORDER_MAX_PROPERTIES properties keep their declaration order, as does property_order="schema" everywhere (the
backend enforces it itself)."""

from __future__ import annotations


import pytest
import torch

from hf_attn_patch.grammar import GrammarError, GrammarSpec, JSONSchemaLogitsProcessor, compile_grammar
from hf_attn_patch.grammar.generate_kwargs import processor_from_generate_kwargs
from hf_attn_patch.grammar.schema_keys import ANY_ORDER_MAX_PROPERTIES

from .conftest import tiny_model
from .test_grammar_schemas import _is_valid, _replay

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["a", "b-c"],
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b-c": {"type": "string", "maxLength": 3},
        "d.e": {
            "type": "object",
            "properties": {"x": {"type": "boolean"}, "y": {"type": "null"}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
}


def test_any_order(stories):
    grammar = compile_grammar(GrammarSpec.json_schema(SCHEMA, "any"), stories[1])
    for text in ('{"a": 1, "b-c": "x"}', '{"b-c": "x", "a": 1}', '{"d.e": {"y": null, "x": true}, "b-c": "", "a": 0}'):
        assert _replay(grammar, text), text
    for text in (
        '{"b-c": "x"}',
        '{"a": 1, "a": 2, "b-c": "x"}',
        '{"a": 1, "b-c": "x", "bxc": 1}',
        '{"a": 1, "b-c": "x", "d.e": {"y": null}}',
        '{"a": 10, "b-c": "x"}',
    ):
        assert not _replay(grammar, text), text


def test_any_order_is_the_default(stories):
    """GrammarSpec, JSONSchemaLogitsProcessor and response_format (generate(), the engine, the server) all accept
    the keys in another order unless asked for the declaration order."""
    tok = stories[1]
    rf = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    grammars = [
        compile_grammar(GrammarSpec.json_schema(SCHEMA), tok),
        JSONSchemaLogitsProcessor(SCHEMA, tok).grammars[0],
        processor_from_generate_kwargs(response_format=rf, tokenizer=tok).grammars[0],
    ]
    for grammar in grammars:
        assert _replay(grammar, '{"b-c": "x", "a": 1}') and not _replay(grammar, '{"b-c": "x"}')


def test_schema_order_on_request(stories):
    tok = stories[1]
    rf = {"type": "json_schema", "json_schema": {"schema": SCHEMA, "property_order": "schema"}}
    for grammar in (
        compile_grammar(GrammarSpec.json_schema(SCHEMA, "schema"), tok),
        processor_from_generate_kwargs(response_format=rf, tokenizer=tok).grammars[0],
    ):
        assert grammar.checks is None  # exact in the backend
        assert _replay(grammar, '{"a": 1, "b-c": "x"}') and not _replay(grammar, '{"b-c": "x", "a": 1}')
    assert compile_grammar(GrammarSpec.tagged_json(SCHEMA, "<a>", "</a>", "schema"), tok).checks is None
    with pytest.raises(GrammarError, match="property_order"):
        GrammarSpec.json_schema(SCHEMA, "sorted")


@pytest.mark.parametrize("n", [ANY_ORDER_MAX_PROPERTIES, ANY_ORDER_MAX_PROPERTIES + 1])
def test_large_objects_keep_declaration_order(stories, n):
    """Up to the limit, keys in any order; above it (the backend's compile time grows about cubically with the
    properties in any order), declaration order, with required keys still enforced."""
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["k0"],
        "properties": {f"k{i}": {"type": "integer"} for i in range(n)},
    }
    grammar = compile_grammar(GrammarSpec.json_schema(schema), stories[1])
    assert _replay(grammar, '{"k1": 1, "k0": 0}') == (n <= ANY_ORDER_MAX_PROPERTIES)
    assert _replay(grammar, '{"k0": 0, "k1": 1}') and not _replay(grammar, '{"k1": 1}')


def test_random_model_in_any_order(stories):
    tok = stories[1]
    proc = JSONSchemaLogitsProcessor(SCHEMA, tok)
    proc.grammars = [compile_grammar(GrammarSpec.json_schema(SCHEMA, "any"), tok)]
    torch.manual_seed(0)
    prompt = torch.tensor([[tok.bos_token_id]] * 6)
    out = tiny_model("llama", vocab_size=512, seed=3).generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=80,
        do_sample=True,
        logits_processor=[proc],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    for row, reason in zip(out[:, 1:].tolist(), proc.finish_reasons):
        if tok.eos_token_id in row:
            text = tok.decode(row[: row.index(tok.eos_token_id)])
            assert _is_valid(SCHEMA, text) or (reason or "").startswith("check_failed"), (text, reason)


def test_a_key_that_can_only_repeat_is_masked_as_it_starts(stories):
    """In a closed object with keys in any order, a key whose prefix only names already present complete is masked
    where it starts (not only at its closing quote, where no continuation would be left), and so is a comma once
    every name is present; a prefix that an absent name completes stays allowed."""
    from hf_attn_patch.grammar import bitmask as bm

    closed = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"ab": {"type": "integer"}, "b": {"type": "integer"}},
    }
    grammar = compile_grammar(GrammarSpec.json_schema(closed), stories[1])
    adapter = grammar.adapter
    ids = {bytes(b): t for t, b in enumerate(adapter.token_bytes()) if bytes(b) in (b"a", b"b", b",")}

    def allowed(text: str) -> dict:
        state, mask = grammar.new_state(), bm.allocate_bitmask(1, adapter.vocab_size)
        assert state.accept_tokens(adapter.llguidance_tokenizer().tokenize_str(text)) > 0
        state.fill_bitmask(mask, 0)
        row = bm.unpack(mask, adapter.vocab_size)[0]
        return {k.decode(): bool(row[t]) for k, t in ids.items()}

    assert allowed('{"b": 1, "') == {"a": True, "b": False, ",": False}
    assert allowed('{"ab": 1, "')["a"] is False and allowed('{"ab": 1, "')["b"] is True
    assert allowed('{"ab": 1, "b": 2')[","] is False and allowed('{"ab": 1')[","] is True
    assert _replay(grammar, '{"b": 1, "ab": 2}') and not _replay(grammar, '{"b": 1, "b": 2}')
