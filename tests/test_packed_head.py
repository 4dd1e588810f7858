"""engine/packed_head.py: the packed lm_head computes the model's own lm_head within fp32 rounding, follows weight
changes, leaves the module as it was, and the engine's greedy tokens stay those of generate()."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.engine.packed_head import PackedHead

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def test_packed_head_matches_linear_and_follows_the_weight():
    torch.manual_seed(0)
    head = torch.nn.Linear(96, 1000, bias=True)
    packed = PackedHead(head)
    for rows in (0, 1, 7, 33):
        x = torch.randn(1, rows, 96)
        # fp32, a sum of 96 products of O(1) terms: rounding <= 96 x 6e-8 x sum|x w| ~ 1e-5; 1e-4 leaves margin
        torch.testing.assert_close(packed.forward(x), head(x), atol=1e-4, rtol=0)
    with torch.no_grad():
        head.weight.mul_(-2)  # in place: the version counter moves, the packed copy must be made again
    x = torch.randn(5, 96)
    torch.testing.assert_close(packed.forward(x), head(x), atol=1e-4, rtol=0)
    with packed.swapped():
        assert "forward" in head.__dict__
    assert "forward" not in head.__dict__


def test_only_fp32_cpu_linear_heads_are_packed():
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    model = LlamaForCausalLM(config)
    assert PackedHead.for_model(model) is not None
    assert PackedHead.for_model(model.to(torch.bfloat16)) is None


def test_engine_with_packed_head_is_greedy_exact(stories):
    """stories260k (fp32, CPU): the engine runs the packed head, its greedy tokens are generate()'s, and the model's
    lm_head is its own again after each step (tests/test_engine.py checks every batching setting the same way)."""
    model, tok = stories
    engine = Engine(model, tok, block_size=4, max_batch_tokens=64)
    assert engine.runner._head is not None
    prompts = ["Once upon a time, there was a little girl", "The cat sat", "Tom and his dog went to the park."]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 pad_token_id=0)  # fmt: skip
        assert out.token_ids == ref[0, len(ids) :].tolist()
    assert "forward" not in model.lm_head.__dict__
