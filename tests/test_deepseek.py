"""Our MultiHeadLatentAttention against transformers' own DeepseekV3Attention with the same weights."""

from __future__ import annotations

import pytest
import torch

from hf_attn_patch.attention import MultiHeadLatentAttention
from hf_attn_patch.converters.exact import to_variant

from .conftest import tiny_model
from .test_exactness import ATOL, CallCounter, stepwise_logits


@pytest.mark.parametrize("absorb", ["never", "always", "auto"])
@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("rope_interleave", [True, False])
def test_deepseek_v3_matches_stock(absorb, q_lora_rank, rope_interleave, padded_batch):
    ids, mask = padded_batch
    stock = tiny_model("deepseek_v3", q_lora_rank=q_lora_rank, rope_interleave=rope_interleave)
    model = to_variant(stock, "mla")
    layers = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    assert len(layers) == stock.config.num_hidden_layers
    for layer in layers:
        layer.absorb = absorb
    counter = CallCounter(model)
    keep = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, attention_mask=mask).logits[keep], stock(ids, attention_mask=mask).logits[keep], atol=ATOL, rtol=0
        )
        torch.testing.assert_close(
            stepwise_logits(model, ids, mask, 4), stepwise_logits(stock, ids, mask, 4), atol=ATOL, rtol=0
        )
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
    assert counter.calls > 0


def test_deepseek_cache_layout_is_shared(padded_batch):
    """Our module writes the same latent and RoPE key into the cache as DeepSeek's own (bitwise, naive path)."""
    from transformers import DynamicCache

    ids, mask = padded_batch
    stock = tiny_model("deepseek_v3")
    model = to_variant(stock, "mla")
    caches = []
    for m in (stock, model):
        cache = DynamicCache(config=m.config)
        with torch.no_grad():
            m(ids, attention_mask=mask, past_key_values=cache)
        caches.append(cache.layers[0])
    assert torch.equal(caches[0].keys, caches[1].keys)
    assert torch.equal(caches[0].values, caches[1].values)
