"""hf_attn_patch.kernels on CPU: the pure-torch reference ops against dense SDPA on the gathered K/V, the
backend dispatch, bad input, the wiring into the "paged_kv" attention function, and (in a subprocess, under
TRITON_INTERPRET=1) the Triton kernels against the reference: tests/test_kernels_backends.py, which also holds the
CUDA grid.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_attn_patch.kernels import ops as kernels
from hf_attn_patch.kernels import reference

ROOT = Path(__file__).resolve().parents[1]


def _load_kv_storage():
    """cache/kv_storage.py loaded by path: it needs only torch, while importing hf_attn_patch.cache needs
    transformers, which scripts/gpu_check.sh's kernels-only fallback (a GPU machine without a supported transformers) lacks."""
    spec = importlib.util.spec_from_file_location("_kv_storage", ROOT / "hf_attn_patch" / "cache" / "kv_storage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KVStorage


KVStorage = _load_kv_storage()
ODD_LENGTHS = (1, 15, 17, 63, 500)  # one row each: every call sees all of them
GQA = [(4, 4), (8, 2), (8, 1), (16, 2)]  # (H_q, H_kv): ratios 1, 4, 8 (MQA), 8


def make_paged(context_lens, heads_kv, d_k, d_v, block_size, dtype=torch.float32, seed=0, device="cpu", table_pad=-1):
    """Random K/V in a KVStorage laid out as PagedKVCache and the engine keep it (head-major; one KV head: keys and
    values fused, as for MLA's [c | k_rope] with d_v = 0), rows scattered over shuffled blocks (block 0 unused, like
    the null block), table entries past a row's end = table_pad, and each row's dense K [L, H_kv, d_k],
    V [L, H_kv, d_v]. key / value: the kernels' flat strided views [slots, H_kv, d]; storage: the fused rows
    [slots, 1, d_k + d_v] (one KV head only)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    max_blocks = max(need) + 1  # one spare column: entries past the end must never be read
    num_blocks = sum(need) + 3
    slots = num_blocks * block_size
    like = torch.empty(0, dtype=dtype, device=device)
    kv = KVStorage(num_blocks, block_size, heads_kv, d_k, d_v, like, fused=heads_kv == 1)
    keys = torch.randn(heads_kv, slots, d_k, generator=gen).to(dtype)
    values = torch.randn(heads_kv, slots, d_v, generator=gen).to(dtype)
    kv.write(torch.arange(slots, device=device), keys.to(device), values.to(device))
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.full((len(context_lens), max_blocks), table_pad, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, (n, k) in enumerate(zip(context_lens, need)):
        tables[b, :k] = torch.tensor(order[:k], dtype=torch.int32)
        order = order[k:]
        row_slots = reference.token_slots(tables[b : b + 1].clamp(min=0), block_size, n)[0]
        dense_k.append(keys.transpose(0, 1)[row_slots])  # on CPU
        dense_v.append(values.transpose(0, 1)[row_slots])
    return SimpleNamespace(
        storage=kv.rows if kv.fused else None,
        key=kv.key_cache,
        value=kv.value_cache,  # views of the storage
        tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        dense_k=dense_k,
        dense_v=dense_v,
        block_size=block_size,
    )


def dense_attention(q, k, v, scale, allowed=None, softcap=None):
    """Naive math in float64: q [T, H_q, d], k [L, H_kv, d], v [L, H_kv, d_v], allowed [T, L] -> [T, H_q, d_v].
    SDPA (enable_gqa) unless softcap is set, which SDPA has no argument for."""
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # [H, T/L, d]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True).transpose(0, 1)
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = softcap * torch.tanh(q @ k.transpose(1, 2) * scale / softcap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


# Reference vs dense, float64 oracle. fp32: 1e-5 (different summation order only). fp16 / bf16: the reference
# computes in fp32 from the same rounded inputs and rounds its output once, so the error is the output's rounding:
# half an ulp at |out| < 2 is 1e-3 (fp16, 10-bit mantissa) and 8e-3 (bf16, 7-bit), with a margin.
REF_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads_q,heads_kv", GQA)
def test_reference_paged_decode_matches_dense_sdpa(dtype, block_size, heads_q, heads_kv):
    d = 32
    pages = make_paged(ODD_LENGTHS, heads_kv, d, d, block_size, dtype)
    query = torch.randn(len(ODD_LENGTHS), heads_q, d).to(dtype)
    out = reference.paged_decode_attention(
        query, pages.key, pages.value, pages.tables, pages.context_lens, block_size=block_size
    )
    assert out.shape == (len(ODD_LENGTHS), heads_q, d) and out.dtype == dtype
    for b in range(len(ODD_LENGTHS)):
        want = dense_attention(query[b : b + 1], pages.dense_k[b], pages.dense_v[b], d**-0.5)[0]
        torch.testing.assert_close(out[b].double(), want, atol=REF_TOL[dtype], rtol=REF_TOL[dtype])


def test_reference_paged_decode_options_match_dense():
    """key_mask (left padding), sliding window, softcap, d_k != d_v, 4-D block view of the same storage."""
    lengths, bs, d_k, d_v, window, cap, scale = (9, 40, 17), 8, 12, 20, 11, 3.0, 0.4
    pages = make_paged(lengths, 2, d_k, d_v, bs)
    query = torch.randn(3, 6, d_k)
    key_mask = torch.rand(3, 40) > 0.3
    key_mask[:, 8:] = True  # the query's own key (ctx - 1) stays visible
    key4 = pages.key.unflatten(0, (-1, bs))  # [num_blocks, block_size, H, d_k]: block_size from the shape
    out = reference.paged_decode_attention(
        query,
        key4,
        pages.value.unflatten(0, (-1, bs)),
        pages.tables,
        pages.context_lens,
        scale=scale,
        softcap=cap,
        sliding_window=window,
        key_mask=key_mask,
    )
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        allowed = (key_mask[b, :n] & (pos > n - 1 - window))[None]
        want = dense_attention(query[b : b + 1], pages.dense_k[b], pages.dense_v[b], scale, allowed, cap)[0]
        torch.testing.assert_close(out[b].double(), want, atol=REF_TOL[torch.float32], rtol=REF_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reference_mla_decode_matches_dense_sdpa(dtype, block_size):
    """MLA as MQA: key = [c | k_rope] (d_c + d_r), value = c, one latent head shared by all H query heads."""
    d_c, d_r, heads = 64, 16, 8
    pages = make_paged(ODD_LENGTHS, 1, d_c + d_r, 0, block_size, dtype)
    latent = pages.storage  # [slots, 1, d_c + d_r]
    q_latent, q_rope = torch.randn(len(ODD_LENGTHS), heads, d_c).to(dtype), torch.randn(5, heads, d_r).to(dtype)
    scale = 0.125
    out = reference.mla_decode(
        q_latent, q_rope, latent, pages.tables, pages.context_lens, block_size=block_size, scale=scale
    )
    assert out.shape == (5, heads, d_c)
    for b in range(5):
        rows = pages.dense_k[b]  # [L, 1, d_c + d_r]
        want = dense_attention(torch.cat((q_latent[b], q_rope[b]), -1)[None], rows, rows[..., :d_c], scale)[0]
        torch.testing.assert_close(out[b].double(), want, atol=REF_TOL[dtype], rtol=REF_TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads_q,heads_kv", [(4, 4), (8, 1)])
@pytest.mark.parametrize("window", [None, 7])
def test_reference_paged_prefill_matches_dense_sdpa(block_size, heads_q, heads_kv, window):
    """Packed queries: the last T_b positions of each sequence (T_b = L_b: plain prefill; T_b < L_b: a chunk
    after cached context), bottom-right causal."""
    lengths, q_lens, d = (1, 15, 17, 63, 500), (1, 15, 5, 1, 37), 16
    pages = make_paged(lengths, heads_kv, d, d, block_size)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), heads_q, d)
    out = reference.paged_prefill_attention(
        query,
        pages.key,
        pages.value,
        pages.tables,
        cu,
        pages.context_lens,
        block_size=block_size,
        sliding_window=window,
    )
    for b, (n, t) in enumerate(zip(lengths, q_lens)):
        qpos, kpos = torch.arange(n - t, n)[:, None], torch.arange(n)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed = allowed & (kpos > qpos - window)
        want = dense_attention(query[cu[b] : cu[b + 1]], pages.dense_k[b], pages.dense_v[b], d**-0.5, allowed)
        torch.testing.assert_close(
            out[cu[b] : cu[b + 1]].double(), want, atol=REF_TOL[torch.float32], rtol=REF_TOL[torch.float32]
        )


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_reference_bitmask_matches_bit_by_bit(vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32) + 1  # one word more than needed: extra bits are ignored
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    expected = logits.clone()
    for b in range(3):
        for t in range(vocab):
            if not (int(bitmask[b, t // 32]) >> (t % 32)) & 1:  # Python ints: bit 31 of a negative word is 1
                expected[b, t] = float("-inf")
    out = kernels.apply_token_bitmask(logits, bitmask)
    assert out is logits and torch.equal(logits, expected)


# -- dispatch ----------------------------------------------------------------------------------------------------


def _small_decode():
    pages = make_paged((5, 20), 2, 8, 8, 4)
    return (torch.randn(2, 4, 8), pages.key, pages.value, pages.tables, pages.context_lens), dict(block_size=4)


def test_auto_falls_back_to_torch_on_cpu():
    args, kw = _small_decode()
    assert torch.equal(kernels.paged_decode_attention(*args, **kw), reference.paged_decode_attention(*args, **kw))
    assert torch.equal(
        kernels.paged_decode_attention(*args, **kw, backend="torch"), reference.paged_decode_attention(*args, **kw)
    )


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter makes triton run on CPU")
def test_explicit_unavailable_backend_raises():
    args, kw = _small_decode()
    with pytest.raises(kernels.BackendUnavailableError, match="flash_attn"):
        kernels.paged_decode_attention(*args, **kw, backend="flash_attn")
    with pytest.raises(kernels.BackendUnavailableError, match="CUDA"):
        kernels.paged_decode_attention(*args, **kw, backend="triton")
    with pytest.raises(kernels.BackendUnavailableError, match="CUDA"):
        kernels.apply_token_bitmask(torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.int32), backend="triton")
    with pytest.raises(ValueError, match="no backend='triton'"):
        q = torch.randn(3, 4, 8)
        kernels.paged_prefill_attention(
            q, args[1], args[2], args[3], torch.tensor([0, 1, 3]), args[4], **kw, backend="triton"
        )
    with pytest.raises(ValueError, match="backend='cuda'"):
        kernels.paged_decode_attention(*args, **kw, backend="cuda")


def _run(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_cpu_import_and_auto_never_import_backends_or_touch_cuda():
    """With triton made unimportable, the package imports and every op runs on CPU; an explicit triton request
    names the import error. (torch itself may import triton: hence blocking it rather than checking sys.modules.)"""
    result = _run(
        """
        import sys
        sys.modules["triton"] = sys.modules["flash_attn"] = None  # `import triton` now raises ImportError
        import torch
        from hf_attn_patch.kernels import ops as kernels
        q = torch.randn(1, 2, 4); cache = torch.randn(8, 1, 4); table = torch.tensor([[0, 1]])
        out = kernels.paged_decode_attention(q, cache, cache, table, torch.tensor([7]), block_size=4)
        kernels.mla_decode(q, q[..., :1], torch.randn(8, 1, 5), table, torch.tensor([7]), block_size=4)
        kernels.apply_token_bitmask(torch.zeros(1, 40), torch.zeros(1, 2, dtype=torch.int32))
        assert "hf_attn_patch.kernels.triton_ops" not in sys.modules
        assert not torch.cuda.is_initialized()
        try:
            kernels.apply_token_bitmask(torch.zeros(1, 40), torch.zeros(1, 2, dtype=torch.int32), backend="triton")
        except kernels.BackendUnavailableError as error:
            print("raised:", error)
        """,
        env={"TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "raised:" in result.stdout and "could not be imported" in result.stdout


def test_bad_input_names_the_argument():
    args, kw = _small_decode()
    q, k, v, tables, lens = args
    cases = [
        (dict(block_tables=tables.clone().fill_(99)), r"block_tables\[0, 0\] = 99 is out of range \[0, 10\)"),
        (dict(context_lens=torch.tensor([5, 40], dtype=torch.int32)), "context_lens must lie in"),
        (dict(block_tables=tables.float()), "block_tables must be a 2-D int32/int64"),
        (dict(query=q.double()), "key_cache has dtype torch.float32 but query has torch.float64"),
        (dict(query=torch.randn(2, 3, 8)), "H_q=3 must be a multiple"),
        (dict(query=torch.randn(2, 4, 6)), "head dim 6"),
        (dict(value_cache=v[:8]), "same slots and heads"),
        (dict(key_mask=torch.ones(3, 20, dtype=torch.bool)), "key_mask must be bool"),
    ]
    for change, message in cases:
        call = dict(query=q, key_cache=k, value_cache=v, block_tables=tables, context_lens=lens, **kw) | change
        with pytest.raises(ValueError, match=message):
            kernels.paged_decode_attention(**call)
    with pytest.raises(ValueError, match="block_size=None"):
        kernels.paged_decode_attention(q, k, v, tables, lens)
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        kernels.paged_decode_attention(q, k.unflatten(0, (-1, 4)), v.unflatten(0, (-1, 4)), tables, lens, block_size=8)
    with pytest.raises(ValueError, match="latent_cache rows"):
        kernels.mla_decode(q, q[..., :2], k, tables, lens, block_size=4)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        kernels.paged_prefill_attention(q, k, v, tables, torch.tensor([0, 1, 5]), lens, block_size=4)
    with pytest.raises(ValueError, match=r"bitmask \(1, 1\) does not cover logits \(1, 40\)"):
        kernels.apply_token_bitmask(torch.zeros(1, 40), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        kernels.apply_token_bitmask(torch.zeros(1, 40), torch.zeros(1, 2, dtype=torch.int64))


# -- wiring into the registered "paged_kv" attention ----------------------------------------------------------------


@pytest.mark.parametrize("model_type,batch_lengths", [("llama", (9, 4, 13)), ("llama", (11,)), ("mistral", (9, 4, 13))])
def test_paged_attention_forward_decode_goes_through_the_kernel_entry(model_type, batch_lengths, monkeypatch):
    """With the CUDA gate opened on CPU, decode steps call kernels.paged_decode_attention (auto -> the torch twin)
    on the pages by block table (block_size 4; left padding is not stored; mistral: the window is the layer's), and
    greedy tokens match sdpa with DynamicCache."""
    from hf_attn_patch import PagedKVCache
    from hf_attn_patch.cache import metadata

    from .conftest import tiny_model
    from .test_paged_cache import ragged

    model = tiny_model(model_type)
    ids, mask = ragged(lengths=batch_lengths)
    kw = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=8, do_sample=False)
    expected = model.generate(ids, **kw)
    calls = []
    original = kernels.paged_decode_attention

    def spy(*args, **kwargs):
        calls.append((kwargs["block_size"], kwargs["sliding_window"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "paged_decode_attention", spy)
    monkeypatch.setattr(metadata, "use_kernels", lambda query: True)
    model.set_attn_implementation("paged_kv")
    try:
        out = model.generate(ids, cache=PagedKVCache(model.config, block_size=4), **kw)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(out, expected)
    assert len(calls) == 7 * model.config.num_hidden_layers  # every decode step after the prefill, every layer
    assert set(calls) == {(4, model.config.sliding_window if model_type == "mistral" else None)}


def test_paged_attention_forward_cpu_path_is_the_reference():
    """On CPU the kernel gate is shut: the reference (gather + SDPA) runs, bit for bit as before."""
    from hf_attn_patch.cache import metadata

    assert metadata.use_kernels(torch.zeros(1, 1, 1, 1)) is False


# -- the Triton kernels, interpreted on CPU in a subprocess ---------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the backend tests run compiled, in-process")
def test_triton_kernels_under_the_interpreter():
    """tests/test_kernels_backends.py under TRITON_INTERPRET=1 in its own process (the variable must be set before
    triton is imported, and must not leak into the other tests)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels_backends.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
