"""The attempt budget of checked rows (grammar/attempts.py): counted per value, free for structural rules (a member
missing at an object's close, keys in any order), never inside the search for the smallest valid completion."""

from __future__ import annotations

import json


import hf_attn_patch.grammar.completion as completion
import hf_attn_patch.grammar.schema_keys as schema_keys
from hf_attn_patch.grammar import GrammarSpec, compile_grammar
from hf_attn_patch.grammar import bitmask as bm

from .test_grammar_schemas import _is_valid, _replay

# 80 required keys: keys in any order mask '}' after every member until the last one (the grammar cannot say it)
MANY_REQUIRED = {
    "type": "object",
    "additionalProperties": False,
    "required": [f"k{i}" for i in range(80)],
    "properties": {f"k{i}": {"type": "integer"} for i in range(80)},
}
# 24 governed strings in one row: each refuses its closing quote at several steps (a prefix is too short)
LONG_WORDS = {"type": "array", "items": {"type": "string", "not": {"maxLength": 9}}}
NEEDS_A_SEVEN = {
    "type": "array",
    "maxItems": 6,
    "contains": {"const": 7},
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
}


def test_keys_in_any_order_cost_no_attempts(stories, monkeypatch):
    """A long valid document in any key order is not cut by the budget (it was: 64 refused '}' per row)."""
    monkeypatch.setattr(schema_keys, "ANY_ORDER_MAX_PROPERTIES", 80)  # more refused closes than the budget
    grammar = compile_grammar(GrammarSpec.json_schema(MANY_REQUIRED, "any"), stories[1])
    assert grammar.checks is not None
    doc = {f"k{i}": i for i in reversed(range(80))}
    assert _replay(grammar, json.dumps(doc))
    assert not _replay(grammar, json.dumps({k: v for k, v in doc.items() if k != "k0"}))


def test_attempts_are_counted_per_value(stories):
    """Many governed values in one row, each with a few refused closes: the row's total is over the limit, no value
    is; a value that keeps failing still runs out (the livelock in test_grammar_schemas)."""
    grammar = compile_grammar(GrammarSpec.json_schema(LONG_WORDS), stories[1])
    grammar.checks.max_attempts = 12
    text = json.dumps([f"once upon {w}" for w in ("a", "the", "my", "our", "one", "two") * 4])
    assert _replay(grammar, text)
    grammar.checks.max_attempts = 2  # a word has more refused closes than that: the row ends early
    assert not _replay(grammar, text)


def test_the_completion_search_has_no_budget(stories, monkeypatch):
    """Out of attempts, the row ends with the smallest valid completion; the search's own masks never start another
    search (a search inside a search did not end)."""
    depth, calls = [0], [0]
    search = completion.smallest_completion

    def guarded(matcher):
        if depth[0]:
            raise AssertionError("the completion search started a search of its own")
        depth[0], calls[0] = 1, calls[0] + 1
        try:
            return search(matcher)
        finally:
            depth[0] = 0

    monkeypatch.setattr("hf_attn_patch.grammar.checked_matcher.smallest_completion", guarded)
    grammar = compile_grammar(GrammarSpec.json_schema(NEEDS_A_SEVEN), stories[1])
    grammar.checks.max_attempts = 1
    adapter = grammar.adapter
    state = grammar.new_state()
    mask = bm.allocate_bitmask(1, adapter.vocab_size)
    assert state.accept_tokens(adapter.llguidance_tokenizer().tokenize_str("[1, 2")) > 0
    text = "[1, 2"
    for _ in range(64):
        state.fill_bitmask(mask, 0)
        allowed = bm.unpack(mask, adapter.vocab_size)[0].nonzero().flatten().tolist()
        if allowed == [adapter.eos_token_ids[0]]:
            break
        assert len(allowed) == 1, allowed  # the completion, one token at a time
        assert state.accept_token(allowed[0])
        text += adapter.token_bytes()[allowed[0]].decode()
    assert calls[0] == 1 and _is_valid(NEEDS_A_SEVEN, text), (calls, text)


def test_no_valid_end_is_a_failed_check_not_a_dead_end(stories):
    """A root number whose every end fails its check: the backend still sets EOS in its mask (its grammar accepts),
    which must not count as a continuation: the row fails naming the check (it ended as an unnamed dead end)."""
    schema = {"type": "integer", "minimum": 0, "maximum": 10, "not": {"type": "integer", "minimum": 0, "maximum": 10}}
    grammar = compile_grammar(GrammarSpec.json_schema(schema), stories[1])
    state = grammar.new_state()
    mask = bm.allocate_bitmask(1, grammar.adapter.vocab_size)
    assert state.accept_tokens(grammar.adapter.llguidance_tokenizer().tokenize_str("1")) == 1
    assert not state.fill_bitmask(mask, 0)
    assert (state.error() or "").startswith("check_failed: 'not' at #/not"), state.error()
