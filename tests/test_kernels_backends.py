"""The Triton kernels (and flash-attn, when installed) against the pure-torch reference.

Runs compiled on CUDA with the full grid, or under TRITON_INTERPRET=1 on CPU with a few small cases (the
interpreter is slow): tests/test_kernels.py starts this file so in a subprocess, since the variable must be set
before triton is imported. Without either, the module skips itself before importing triton.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
if not (INTERPRET or CUDA):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (tests/test_kernels.py runs it so)", allow_module_level=True)
pytest.importorskip("triton")

from hf_attn_patch.kernels import ops as kernels  # noqa: E402
from hf_attn_patch.kernels import reference  # noqa: E402

from .test_kernels import GQA, ODD_LENGTHS, make_paged  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernel vs reference (both fp32 math on the same rounded inputs). fp32: ieee dots, only the summation order
# differs. fp16 / bf16: the kernel rounds the probabilities to the input dtype before the p @ V product (as flash
# attention does), a relative error of 2^-11 (fp16) / 2^-8 (bf16) per term, on |v| up to ~4, plus one rounding of
# the output (half an ulp: 1e-3 / 8e-3 at |out| < 2); these bounds with a small margin.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def close(out, want, dtype):
    assert out.dtype == want.dtype and out.shape == want.shape
    torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


# (dtype, block_size, (H_q, H_kv), num_splits, lengths); interpreted: one case per dtype, every feature covered once
if CUDA:
    DECODE_CASES = [
        (dtype, bs, gqa, splits, ODD_LENGTHS)
        for dtype, bs, gqa, splits in itertools.product(DTYPES, [16, 32], GQA, [None, 1, 7])
    ]
else:
    DECODE_CASES = [
        (torch.float32, 16, (8, 2), None, ODD_LENGTHS),  # auto split plan over 500 tokens
        (torch.float16, 32, (4, 4), 3, (1, 15, 17, 63)),
        (torch.bfloat16, 16, (8, 1), 1, (17, 63)),  # MQA, one split: the direct-store path
    ]


@pytest.mark.parametrize("dtype,block_size,gqa,num_splits,lengths", DECODE_CASES)
def test_triton_paged_decode_matches_reference(dtype, block_size, gqa, num_splits, lengths):
    from hf_attn_patch.kernels import triton_ops

    heads_q, heads_kv = gqa
    d = 64 if CUDA else 16
    pages = make_paged(lengths, heads_kv, d, d, block_size, dtype, device=DEVICE)
    query = torch.randn(len(lengths), heads_q, d, device=DEVICE).to(dtype)
    args = (query, pages.key, pages.value, pages.tables, pages.context_lens)
    want = reference.paged_decode_attention(*args, block_size=block_size)
    out = triton_ops.paged_decode_attention(*args, block_size=block_size, scale=d**-0.5, num_splits=num_splits)
    close(out, want, dtype)
    close(kernels.paged_decode_attention(*args, block_size=block_size, backend="triton"), want, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_paged_decode_options_match_reference(num_splits):
    """key_mask, sliding window, softcap, d_k != d_v and neither a power of two, a 4-D block view, slot tables
    (block_size 1, as paged_attention_forward passes them)."""
    lengths, bs, d_k, d_v = (9, 40, 17), 8, 12, 20
    pages = make_paged(lengths, 2, d_k, d_v, bs, device=DEVICE)
    query = torch.randn(3, 6, d_k, device=DEVICE)
    key_mask = torch.rand(3, 40, device=DEVICE) > 0.3
    key_mask[:, 8:] = True
    kw = dict(scale=0.4, softcap=3.0, sliding_window=11, key_mask=key_mask)
    key4, value4 = pages.key.unflatten(0, (-1, bs)), pages.value.unflatten(0, (-1, bs))
    want = reference.paged_decode_attention(query, key4, value4, pages.tables, pages.context_lens, **kw)
    from hf_attn_patch.kernels import triton_ops

    out = triton_ops.paged_decode_attention(
        query, pages.key, pages.value, pages.tables, pages.context_lens, block_size=bs, num_splits=num_splits, **kw
    )
    close(out, want, torch.float32)
    slots = reference.token_slots(pages.tables.clamp(min=0), bs, 40)
    out = kernels.paged_decode_attention(
        query, pages.key, pages.value, slots, pages.context_lens, block_size=1, backend="triton", **kw
    )
    close(out, want, torch.float32)


if CUDA:  # (dtype, d_c, d_r, heads, block_size, num_splits): DeepSeek-V3's 512 + 64 with 16 and 128 heads
    MLA_CASES = [
        (dtype, 512, 64, heads, bs, splits)
        for dtype, heads, bs, splits in itertools.product(DTYPES, [16, 128], [16, 64], [None, 1])
    ] + [(torch.float32, 64, 16, 5, 32, 3)]
else:
    MLA_CASES = [(torch.float32, 32, 8, 5, 16, None), (torch.bfloat16, 64, 16, 40, 32, 3)]  # 40 heads: 2 head blocks


@pytest.mark.parametrize("dtype,d_c,d_r,heads,block_size,num_splits", MLA_CASES)
def test_triton_mla_decode_matches_reference(dtype, d_c, d_r, heads, block_size, num_splits):
    from hf_attn_patch.kernels import triton_ops

    lengths = ODD_LENGTHS if CUDA else (1, 17, 63)
    pages = make_paged(lengths, 1, d_c + d_r, 0, block_size, dtype, device=DEVICE)
    q_latent = torch.randn(len(lengths), heads, d_c, device=DEVICE).to(dtype)
    q_rope = torch.randn(len(lengths), heads, d_r, device=DEVICE).to(dtype)
    args = (q_latent, q_rope, pages.storage, pages.tables, pages.context_lens)
    scale = 192**-0.5  # DeepSeek-V3: 1 / sqrt(nope 128 + rope 64)
    want = reference.mla_decode(*args, block_size=block_size, scale=scale)
    out = triton_ops.mla_decode(*args, block_size=block_size, scale=scale, num_splits=num_splits)
    close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [33, 1000] + ([151_936] if CUDA else []))
def test_triton_bitmask_matches_reference(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, -(-vocab // 32)), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen).to(dtype)
    want = reference.apply_token_bitmask(logits.clone(), bitmask)
    got = kernels.apply_token_bitmask(logits.to(DEVICE), bitmask.to(DEVICE), backend="triton")
    assert torch.equal(got.cpu(), want)


# -- CUDA only: auto picks a kernel, flash-attn, the wiring ---------------------------------------------------------

cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (compiled kernels)")
flash_only = pytest.mark.skipif(
    not (CUDA and kernels.available_backends()["flash_attn"]), reason="needs CUDA + flash-attn"
)


@cuda_only
def test_auto_picks_a_gpu_backend_and_matches():
    pages = make_paged(ODD_LENGTHS, 2, 64, 64, 16, torch.float16, device=DEVICE)
    query = torch.randn(5, 8, 64, device=DEVICE, dtype=torch.float16)
    args = (query, pages.key, pages.value, pages.tables, pages.context_lens)
    close(
        kernels.paged_decode_attention(*args, block_size=16),
        reference.paged_decode_attention(*args, block_size=16),
        torch.float16,
    )


@flash_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_decode_and_prefill_match_reference(dtype):
    lengths, bs, d = (1, 300, 700), 256, 128  # flash-attn 2's paged KV: block_size a multiple of 256
    pages = make_paged(lengths, 2, d, d, bs, dtype, device=DEVICE, table_pad=0)
    query = torch.randn(3, 8, d, device=DEVICE, dtype=dtype)
    args = (query, pages.key, pages.value, pages.tables, pages.context_lens)
    want = reference.paged_decode_attention(*args, block_size=bs, sliding_window=100)
    close(kernels.paged_decode_attention(*args, block_size=bs, sliding_window=100, backend="flash_attn"), want, dtype)
    cu = torch.tensor([0, 1, 41, 41 + 700], dtype=torch.int32, device=DEVICE)
    packed = torch.randn(741, 8, d, device=DEVICE, dtype=dtype)
    args = (packed, pages.key, pages.value, pages.tables, cu, pages.context_lens)
    close(
        kernels.paged_prefill_attention(*args, block_size=bs, backend="flash_attn"),
        reference.paged_prefill_attention(*args, block_size=bs),
        dtype,
    )


@cuda_only
@pytest.mark.parametrize("batch_lengths", [(9, 4, 13), (11,)])
def test_paged_kv_generate_on_cuda_uses_the_kernel(batch_lengths, monkeypatch):
    """attn_implementation="paged_kv" on CUDA: decode steps go through the Triton kernel; greedy tokens match sdpa
    with DynamicCache (fp32, where ties are improbable)."""
    hf_attn_patch = __import__("hf_attn_patch")
    if not hasattr(hf_attn_patch, "PagedKVCache"):  # scripts/gpu_check.sh's kernels-only mode (no transformers)
        pytest.skip("the full hf_attn_patch package is not importable here")
    from hf_attn_patch.kernels import triton_ops

    from .conftest import tiny_model
    from .test_paged_cache import ragged

    model = tiny_model("llama").to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in ragged(lengths=batch_lengths))
    kw = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=8, do_sample=False)
    expected = model.generate(ids, **kw)
    calls = []
    original = triton_ops.paged_decode_attention
    monkeypatch.setattr(triton_ops, "paged_decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model.set_attn_implementation("paged_kv")
    try:
        out = model.generate(ids, cache=hf_attn_patch.PagedKVCache(model.config, block_size=4), **kw)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(out, expected)
    assert len(calls) == 7 * model.config.num_hidden_layers
