"""Keys in any order (property_order="any"): an object's keys in another order than its ``properties`` list them are
allowed; a missing required key, a repeated key and an unknown key are not. The default keeps the declaration
order, which the backend enforces itself."""

from __future__ import annotations

import json

import pytest
import torch

from hf_attn_patch.grammar import GrammarError, GrammarSpec, JSONSchemaLogitsProcessor, compile_grammar

from .conftest import tiny_model
from .test_grammar_schemas import _is_valid, _replay

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b-c"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b-c": {"type": "string", "maxLength": 3},
                         "d.e": {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "null"}},
                                 "required": ["x"], "additionalProperties": False}}}


def test_any_order(stories):
    grammar = compile_grammar(GrammarSpec.json_schema(SCHEMA, "any"), stories[1])
    for text in ('{"a": 1, "b-c": "x"}', '{"b-c": "x", "a": 1}', '{"d.e": {"y": null, "x": true}, "b-c": "", "a": 0}'):
        assert _replay(grammar, text), text
    for text in ('{"b-c": "x"}', '{"a": 1, "a": 2, "b-c": "x"}', '{"a": 1, "b-c": "x", "bxc": 1}',
                 '{"a": 1, "b-c": "x", "d.e": {"y": null}}', '{"a": 10, "b-c": "x"}'):
        assert not _replay(grammar, text), text


def test_schema_order_is_the_default(stories):
    grammar = compile_grammar(GrammarSpec.json_schema(SCHEMA), stories[1])
    assert grammar.checks is None  # exact in the backend
    assert _replay(grammar, '{"a": 1, "b-c": "x"}') and not _replay(grammar, '{"b-c": "x", "a": 1}')
    with pytest.raises(GrammarError, match="property_order"):
        GrammarSpec.json_schema(SCHEMA, "sorted")


def test_random_model_in_any_order(stories):
    tok = stories[1]
    proc = JSONSchemaLogitsProcessor(SCHEMA, tok)
    proc.grammars = [compile_grammar(GrammarSpec.json_schema(SCHEMA, "any"), tok)]
    torch.manual_seed(0)
    prompt = torch.tensor([[tok.bos_token_id]] * 6)
    out = tiny_model("llama", vocab_size=512, seed=3).generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=80, do_sample=True, logits_processor=[proc],
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    for row, reason in zip(out[:, 1:].tolist(), proc.finish_reasons):
        if tok.eos_token_id in row:
            text = tok.decode(row[: row.index(tok.eos_token_id)])
            assert _is_valid(SCHEMA, text) or (reason or "").startswith("check_failed"), (text, reason)
