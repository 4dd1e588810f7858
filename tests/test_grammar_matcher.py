"""BatchMatcher: one dead-end policy for every caller, and plain generate(), speculative decoding and the engine give
the same tokens under a grammar, edges included (termination then EOS, a dead end at the logits' width)."""

from __future__ import annotations

import pytest
import torch

from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.grammar import GrammarSpec, compile_grammar
from hf_attn_patch.grammar.matcher import BatchMatcher

from .conftest import tiny_model


def _allowed(bitmask: torch.Tensor, width: int) -> list[list[int]]:
    scores = BatchMatcher.apply(torch.zeros(bitmask.shape[0], width), bitmask)
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in scores]


def test_dead_end_policy(stories):
    _, tok = stories
    grammar = compile_grammar(GrammarSpec.regex("[0-9]+"), tok)
    eos = tok.eos_token_id
    m = BatchMatcher([grammar.new_state(), grammar.new_state()])
    digit, letter = tok.convert_tokens_to_ids("▁"), tok.convert_tokens_to_ids("▁t")
    digit = tok("7", add_special_tokens=False).input_ids[-1]
    assert m.accept_tokens(0, [digit, letter]) == 1  # the letter is rejected: row 0 is a dead end
    assert m.is_dead(0) and "rejected" in m.finish_reason(0) and not m.is_dead(1)
    bitmask = m.fill_bitmask(m.allocate_bitmask(), width=512)
    allowed = _allowed(bitmask, 512)
    assert allowed[0] == [eos] and eos not in allowed[1] and len(allowed[1]) > 1  # EOS only where accepting
    assert m.accept_tokens(0, [eos]) == 0 and m.is_dead(0)  # the forced EOS is not consumed; the reason stays
    m.rollback(0, 1)  # below the dead end: alive again
    assert not m.is_dead(0) and m.finish_reason(0) is None
    # no token allowed within the logits' width: dead end, only EOS (never an out-of-range token)
    m = BatchMatcher([compile_grammar(GrammarSpec.regex("zz"), tok).new_state()])
    assert _allowed(m.fill_bitmask(m.allocate_bitmask(), width=40), 40) == [[eos]]
    assert "no token allowed" in m.finish_reason(0)
    # termination: after the grammar completes and EOS is taken, only EOS; finish reason "eos"
    m = BatchMatcher([compile_grammar(GrammarSpec.regex("7"), tok).new_state()])
    assert m.accept_tokens(0, [digit, eos]) == 2 and m.is_terminated(0) and m.finish_reason(0) == "eos"
    assert _allowed(m.fill_bitmask(m.allocate_bitmask()), 512) == [[eos]]


PROMPTS = ["Once upon a time, there was a little girl named Lily.", "The cat sat on the mat. The cat"]
CASES = {
    "json": (
        {
            "type": "json_schema",
            "json_schema": {
                "schema": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {"name": {"type": "string", "maxLength": 8}},
                }
            },
        },
        None,
    ),
    "choice-terminates": (None, {"type": "regex", "pattern": "(yes|no)"}),  # complete -> only EOS may follow
}


def _three_ways(model, tok, prompts, response_format, grammar, max_new: int):
    """Greedy tokens per prompt from plain generate(), prompt-lookup speculative generate() and the engine."""
    kw = dict(max_new_tokens=max_new, do_sample=False, tokenizer=tok, pad_token_id=0)
    kw.update({"response_format": response_format} if response_format else {"grammar": grammar})
    plain, spec = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        plain.append(model.generate(ids, **kw)[0, len(prompt) :].tolist())
        spec.append(model.generate(ids, prompt_lookup_num_tokens=3, **kw)[0, len(prompt) :].tolist())
    engine = Engine(model, tok, block_size=4)
    params = SamplingParams(max_tokens=max_new, temperature=0, response_format=response_format, grammar=grammar)
    ours = [out.token_ids for out in engine.generate(prompts, params)]
    return plain, spec, ours


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    """generate() pads finished rows; the engine stops at EOS (a grammar-forced EOS is not emitted: see below)."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("case", list(CASES))
def test_plain_speculative_and_engine_agree(stories, case, one_torch_thread):
    model, tok = stories
    eos = tok.eos_token_id
    prompts = [tok(p).input_ids for p in PROMPTS]
    plain, spec, ours = _three_ways(model, tok, prompts, *CASES[case], max_new=30)
    for p, s, e in zip(plain, spec, ours):
        p, s = _until_eos(p, eos), _until_eos(s, eos)
        assert p == s
        # the engine ends a request when its grammar can only end: the EOS generate() is forced to emit then is
        # not emitted (finish_reason "stop"); everything before it is identical
        assert e == (p[:-1] if p and p[-1] == eos and (not e or e[-1] != eos) else p)


def test_dead_end_at_the_logits_width_agrees(stories, one_torch_thread):
    """A model whose logits cover 40 tokens cannot spell "zz": every path emits EOS at once, never token 0."""
    _, tok = stories
    model = tiny_model("llama", vocab_size=40)
    model.generation_config.eos_token_id = tok.eos_token_id
    prompts = [[1, 5, 9, 13], [1, 7, 8]]
    plain, spec, ours = _three_ways(model, tok, prompts, None, {"type": "regex", "pattern": "zz"}, max_new=5)
    eos = tok.eos_token_id
    for p, s, e in zip(plain, spec, ours):
        assert _until_eos(p, eos) == _until_eos(s, eos) == e == [eos]
