"""Our MultiHeadLatentAttention against transformers' own DeepseekV3Attention with the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_attn_patch
from hf_attn_patch import PagedKVCache
from hf_attn_patch.attention import MultiHeadLatentAttention, mla
from hf_attn_patch.compat import cache_kwarg
from hf_attn_patch.converters.targets.exact import to_variant

from .conftest import tiny_model
from .test_exactness import ATOL, CallCounter, stepwise_logits


def stock_deepseek(model_type: str = "deepseek_v3", **overrides):
    """transformers' own DeepSeek model: built with the patch lifted, so its attention is the stock class."""
    with hf_attn_patch.unpatched():
        model = tiny_model(model_type, **overrides)
    assert type(model.model.layers[0].self_attn).__name__ in ("DeepseekV3Attention", "DeepseekV2Attention")
    return model


@pytest.mark.parametrize("absorb", ["never", "always", "auto"])
@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize(
    "model_type,rope_interleave", [("deepseek_v3", True), ("deepseek_v3", False), ("deepseek_v2", None)]
)  # V2 always interleaves (complex freqs_cis)
def test_deepseek_matches_stock(absorb, q_lora_rank, model_type, rope_interleave, padded_batch):
    ids, mask = padded_batch
    extra = {} if rope_interleave is None else {"rope_interleave": rope_interleave}
    stock = stock_deepseek(model_type, q_lora_rank=q_lora_rank, **extra)
    model = to_variant(stock, "mla")
    layers = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    assert len(layers) == stock.config.num_hidden_layers
    for layer in layers:
        layer.absorb = absorb
    counter = CallCounter(model)
    keep = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, attention_mask=mask).logits[keep],
            stock(ids, attention_mask=mask).logits[keep],
            atol=ATOL,
            rtol=0,
        )
        torch.testing.assert_close(
            stepwise_logits(model, ids, mask, 4), stepwise_logits(stock, ids, mask, 4), atol=ATOL, rtol=0
        )
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
    assert counter.calls > 0


def test_deepseek_cache_layout_is_shared(padded_batch):
    """Our module writes the same latent and RoPE key into the cache as DeepSeek's own (bitwise, naive path)."""
    ids, mask = padded_batch
    stock = stock_deepseek()
    model = to_variant(stock, "mla")
    caches = []
    for m in (stock, model):
        cache = DynamicCache(config=m.config)
        with torch.no_grad():
            m(ids, attention_mask=mask, **cache_kwarg(cache))
        caches.append(cache.layers[0])
    assert torch.equal(caches[0].keys, caches[1].keys)
    assert torch.equal(caches[0].values, caches[1].values)


def test_absorbed_decode_without_a_mask_matches_stock(monkeypatch):
    """One unpadded row: sdpa drops the all-ones mask, so decode steps reach the absorbed path with no mask, which then
    masks nothing (one query sees every cached key); the logits still match the stock model step by step."""
    stock = stock_deepseek()
    model = to_variant(stock, "mla")
    for layer in (m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)):
        layer.absorb = "always"
    seen = []
    original = mla.mask_bias
    monkeypatch.setattr(mla, "mask_bias", lambda bias, mask, *a: seen.append(mask is None) or original(bias, mask, *a))
    torch.manual_seed(2)
    ids = torch.randint(3, 97, (1, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(
            stepwise_logits(model, ids, mask, 4), stepwise_logits(stock, ids, mask, 4), atol=ATOL, rtol=0
        )
    assert seen and all(seen)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_patched_stock_deepseek_decodes_absorbed_with_both_caches(model_type, padded_batch):
    """A plain DeepSeek-V2/V3 config built while patched gets our module (same weights load as they are); its decode
    steps run the absorbed path, with DynamicCache and PagedKVCache, and generate the stock model's tokens."""
    ids, mask = padded_batch
    stock = stock_deepseek(model_type)
    patched = tiny_model(model_type, seed=1)
    layers = [m for m in patched.modules() if isinstance(m, MultiHeadLatentAttention)]
    assert len(layers) == patched.config.num_hidden_layers and not hasattr(patched.config, "attention_variant")
    patched.load_state_dict(stock.state_dict())  # identical parameter names
    absorbed_calls = []
    for layer in layers:
        original = layer._absorbed
        layer._absorbed = lambda *a, _f=original: absorbed_calls.append(1) or _f(*a)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    reference = stock.generate(ids, **kw)
    assert torch.equal(patched.generate(ids, cache=DynamicCache(config=patched.config), **kw), reference)
    assert torch.equal(patched.generate(ids, cache=PagedKVCache(patched.config, block_size=4), **kw), reference)
    # both runs, every layer: 9 decode steps, plus the 9-token prefill, which the FLOP rule also gives to the
    # absorbed path at these tiny sizes (a long prefill goes naive: test_auto_absorb_picks_by_flops)
    assert layers[0].use_absorbed(ids.shape[1])
    assert len(absorbed_calls) == 2 * 10 * len(layers)
    with torch.no_grad():
        # absorbed decoding reduces through the unnormalized latent (q W_uk^T, then against c): two more reductions
        # (16 and 12 terms) on entries up to ~10, over 4 steps and 2 layers: 1.2e-7 x 4 x 10 x 4 x 2, x3 margin ~ 1e-4
        torch.testing.assert_close(
            stepwise_logits(patched, ids, mask, 4), stepwise_logits(stock, ids, mask, 4), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("length,masked", [(1, False), (1, True), (3, True)])
def test_absorbed_attention_forms_agree(length, masked, monkeypatch):
    """The absorbed attention's three forms (CPU GEMMs over [c | k_rope] rows stored side by side, GEMMs over separate
    c and k_rope, one SDPA call) give the un-absorbed attention over expanded K/V, with and without a mask."""
    layer = next(m for m in to_variant(stock_deepseek(), "mla").modules() if isinstance(m, MultiHeadLatentAttention))
    d_c, d_r, heads, seq, batch = layer.kv_lora_rank, layer.qk_rope_head_dim, layer.num_heads, 11, 2
    torch.manual_seed(3)
    q_nope = torch.randn(batch, heads, length, layer.qk_nope_head_dim)
    q_rope = torch.randn(batch, heads, length, d_r)
    rows = torch.randn(batch, 1, seq, d_c + d_r)  # a cache that stores each token's [c | k_rope] together
    c, k_rope = rows[..., :d_c], rows[..., d_c:]
    allowed = torch.ones(batch, 1, length, seq, dtype=torch.bool).tril(seq - length)  # causal, last `length` queries
    if masked:
        allowed[0, ..., :4] = False  # row 0: left padding
    mask = allowed if masked or length > 1 else None

    w = layer.kv_b_proj.weight.view(heads, -1, d_c)  # expected: expand K, V per head, softmax in float64
    k = torch.cat(
        (torch.einsum("hnc,bsc->bhsn", w[:, : layer.qk_nope_head_dim], c[:, 0]), k_rope.expand(-1, heads, -1, -1)), -1
    ).double()
    v = torch.einsum("hvc,bsc->bhsv", w[:, layer.qk_nope_head_dim :], c[:, 0]).double()
    scores = torch.cat((q_nope, q_rope), -1).double() @ k.transpose(-1, -2) * layer.scaling
    expected = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2)  # [B, T, H, d_v]

    assert mla._joint_rows(c, k_rope) is not None and mla._joint_rows(c.clone(), k_rope.clone()) is None
    forms = {"joint rows": (c, k_rope), "separate": (c.clone(), k_rope.clone())}
    calls, threads = [], torch.get_num_threads()
    monkeypatch.setattr(mla, "_joint_rows", lambda *a, _f=mla._joint_rows: calls.append(1) or _f(*a))
    torch.set_num_threads(2)  # the GEMMs run with more than one thread
    try:
        with torch.no_grad():
            got = {name: layer._absorbed(q_nope, q_rope, *cache, mask)[0] for name, cache in forms.items()}
            assert len(calls) == 2  # both took the GEMMs
            monkeypatch.setattr(mla, "GEMM_ATTENTION_ROWS", 0)
            got["sdpa"] = layer._absorbed(q_nope, q_rope, c, k_rope, mask)[0]
    finally:
        torch.set_num_threads(threads)
    for name, out in got.items():  # fp32 against float64: sums of ~160 products of entries ~1-10, atol 1e-5
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0, msg=name)


def test_gemm_attention_rule():
    """CPU fp32 decode rows with more than one thread take the GEMMs; long prefills, dropout, half precision and a
    single thread keep SDPA."""
    c = torch.zeros(1, 1, 64, 8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert mla._gemm_attention(c, 8, 0.0)
        assert not mla._gemm_attention(c, mla.GEMM_ATTENTION_ROWS + 1, 0.0)
        assert not mla._gemm_attention(c, 8, 0.1)
        assert not mla._gemm_attention(c.bfloat16(), 8, 0.0)
        torch.set_num_threads(1)
        assert not mla._gemm_attention(c, 8, 0.0)
    finally:
        torch.set_num_threads(threads)
