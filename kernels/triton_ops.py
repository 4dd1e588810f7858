"""Triton kernels: paged decode attention (GQA, split-K), MLA latent decode, in-place token-bitmask apply.

Imported only when the Triton backend is picked (never at `import hf_attn_patch.kernels`). The wrappers here take
already validated arguments (see ops.py): flat caches [slots, H, d] with unit stride on the last dim, an int
block_size, a float scale. Verified against kernels/reference.py under TRITON_INTERPRET=1 on CPU; the CUDA grid of
tests/test_kernels.py runs them compiled.

Decode (flash-decoding). Grid (B, H_kv, S): program (b, h, s) loads the G = H_q / H_kv query heads that share KV
head h once, then streams the tokens [s * T_s, (s + 1) * T_s) of row b in tiles of BLOCK_N, so every K/V tile is
read once for all G heads (GQA/MQA reuse). Per head it keeps the online-softmax state in fp32, in base 2:
    m = max_j s_j,  l = sum_j 2^(s_j - m),  acc = sum_j 2^(s_j - m) v_j,   s_j = log2(e) * cap(scale * q . k_j)
With S = 1 it writes acc / l; with S > 1 it writes acc / l and lse = m + log2(l) per split, and a reduce kernel
combines the splits: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s.

Dots take the tiles as loaded (fp16/bf16 -> fp32 accumulate; fp32 with input_precision="ieee", not TF32). Under the
interpreter only, bf16 tiles are cast to fp32 before tl.dot, because the interpreter's numpy dot mis-reads bf16.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(s, valid, m, l, acc):
    """One tile: s [G, N] base-2 scores, valid [N] -> rescaled (m, l, acc) and p [G, N] (acc not yet += p @ v)."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head with nothing visible yet: avoid inf - inf
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None], p


@triton.jit
def _operand(x, UPCAST: tl.constexpr):
    """A tl.dot operand: as loaded, or fp32 (UPCAST: only for bf16 under the interpreter, whose numpy dot
    mis-reads bf16; the values are the same bf16 numbers, so the result is what a bf16 x bf16 -> fp32 dot gives)."""
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _token_slots(
    BT, KMASK, b, n0, hi, stride_btb, stride_kmb, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr
):
    """Positions n0..n0+BLOCK_N of row b -> (slot ids int64 [N], valid [N])."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < hi
    block = tl.load(BT + b * stride_btb + pos // PAGE, mask=valid, other=0).to(tl.int64)
    if HAS_MASK:
        valid = valid & (tl.load(KMASK + b * stride_kmb + pos, mask=valid, other=0) != 0)
    return block * PAGE + pos % PAGE, valid


@triton.jit
def _paged_decode_kernel(
    Q,
    K,
    V,
    BT,
    CTX,
    KMASK,
    O,
    PO,
    PL,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_kmb,
    stride_ob,
    stride_oh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    scale,
    softcap,
    window,
    tokens_per_split,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(CTX + b).to(tl.int32)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, ctx)
    if HAS_WINDOW:  # the query at ctx - 1 sees keys > ctx - 1 - window
        lo = tl.maximum(lo, ctx - window)
    g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dk, dv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + dk[None, :],
        mask=gmask[:, None] & (dk[None, :] < D_K),
        other=0.0,
    )
    q = _operand(q, UPCAST)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    # head offsets in int64: the head-major pools' head stride is slots x d, and kvh x that passes 2^31 in big pools
    head_k, head_v = kvh.to(tl.int64) * stride_kh, kvh.to(tl.int64) * stride_vh
    for n0 in range(lo, hi, BLOCK_N):
        slot, valid = _token_slots(BT, KMASK, b, n0, hi, stride_btb, stride_kmb, PAGE, BLOCK_N, HAS_MASK)
        k = tl.load(
            K + slot[:, None] * stride_ks + head_k + dk[None, :], mask=valid[:, None] & (dk[None, :] < D_K), other=0.0
        )
        s = tl.dot(q, tl.trans(_operand(k, UPCAST)), input_precision=PREC) * scale  # [G, N] fp32
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (e^(2x) + 1) (saturates, never NaN)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        m, l, acc, p = _online_softmax_step(s * 1.4426950408889634, valid, m, l, acc)
        v = tl.load(
            V + slot[:, None] * stride_vs + head_v + dv[None, :], mask=valid[:, None] & (dv[None, :] < D_V), other=0.0
        )
        acc += tl.dot(_operand(p.to(v.dtype), UPCAST), _operand(v, UPCAST), input_precision=PREC)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # no visible key: 0
    if SPLIT:
        tl.store(
            PO + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + dv[None, :],
            out,
            mask=gmask[:, None] & (dv[None, :] < D_V),
        )
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(PL + b * stride_plb + heads * stride_plh + split, lse, mask=gmask)
    else:
        tl.store(
            O + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
            out.to(O.dtype.element_ty),
            mask=gmask[:, None] & (dv[None, :] < D_V),
        )


@triton.jit
def _mla_decode_kernel(
    QL,
    QR,
    C,
    BT,
    CTX,
    KMASK,
    O,
    PO,
    PL,
    stride_qlb,
    stride_qlh,
    stride_qrb,
    stride_qrh,
    stride_cs,
    stride_btb,
    stride_kmb,
    stride_ob,
    stride_oh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    scale,
    tokens_per_split,
    heads_total,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_C: tl.constexpr,
    D_R: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """FlashMLA-style: one latent row [c | k_rope] per token is the key (d_c + d_r) and c is the value, so each
    c tile is loaded once and used for both q_latent . c and p @ c; BLOCK_H heads share every tile."""
    b, hb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(CTX + b).to(tl.int32)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, ctx)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < heads_total
    dc, dr = tl.arange(0, BLOCK_DC), tl.arange(0, BLOCK_DR)
    ql = tl.load(
        QL + b * stride_qlb + heads[:, None] * stride_qlh + dc[None, :],
        mask=hmask[:, None] & (dc[None, :] < D_C),
        other=0.0,
    )
    qr = tl.load(
        QR + b * stride_qrb + heads[:, None] * stride_qrh + dr[None, :],
        mask=hmask[:, None] & (dr[None, :] < D_R),
        other=0.0,
    )
    ql, qr = _operand(ql, UPCAST), _operand(qr, UPCAST)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        slot, valid = _token_slots(BT, KMASK, b, n0, hi, stride_btb, stride_kmb, PAGE, BLOCK_N, HAS_MASK)
        row = C + slot[:, None] * stride_cs
        c = tl.load(row + dc[None, :], mask=valid[:, None] & (dc[None, :] < D_C), other=0.0)
        kr = tl.load(row + D_C + dr[None, :], mask=valid[:, None] & (dr[None, :] < D_R), other=0.0)
        c_op = _operand(c, UPCAST)
        s = tl.dot(ql, tl.trans(c_op), input_precision=PREC) + tl.dot(
            qr, tl.trans(_operand(kr, UPCAST)), input_precision=PREC
        )
        m, l, acc, p = _online_softmax_step(s * (scale * 1.4426950408889634), valid, m, l, acc)
        acc += tl.dot(_operand(p.to(c.dtype), UPCAST), c_op, input_precision=PREC)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if SPLIT:
        tl.store(
            PO + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + dc[None, :],
            out,
            mask=hmask[:, None] & (dc[None, :] < D_C),
        )
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(PL + b * stride_plb + heads * stride_plh + split, lse, mask=hmask)
    else:
        tl.store(
            O + b * stride_ob + heads[:, None] * stride_oh + dc[None, :],
            out.to(O.dtype.element_ty),
            mask=hmask[:, None] & (dc[None, :] < D_C),
        )


@triton.jit
def _split_reduce_kernel(
    PO,
    PL,
    O,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    num_splits,
    D_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Program (b, h): out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M); empty splits have lse = -inf, o = 0.
    The split outputs are streamed one row at a time (a [splits, d_v] tile would not fit in registers at d_v 512)."""
    b, h = tl.program_id(0), tl.program_id(1)
    s, dv = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_DV)
    lse_row = PL + b * stride_plb + h * stride_plh
    top = tl.max(tl.load(lse_row + s, mask=s < num_splits, other=float("-inf")), 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp2(tl.load(lse_row + s, mask=s < num_splits, other=float("-inf")) - top), 0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for i in range(0, num_splits):
        weight = tl.exp2(tl.load(lse_row + i) - top)
        acc += weight * tl.load(PO + b * stride_pob + h * stride_poh + i * stride_pos + dv, mask=dv < D_V, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + dv, out.to(O.dtype.element_ty), mask=dv < D_V)


@triton.jit
def _bitmask_kernel(L, M, vocab, stride_lb, stride_mb, BLOCK: tl.constexpr):
    """Program (b, t): tokens [t * BLOCK, (t + 1) * BLOCK) of row b; writes -inf only where the bit is 0."""
    b, t = tl.program_id(0), tl.program_id(1)
    tok = t * BLOCK + tl.arange(0, BLOCK)
    inside = tok < vocab
    word = tl.load(M + b * stride_mb + tok // 32, mask=inside, other=-1)  # -1: all bits set, nothing written
    allowed = ((word >> (tok % 32)) & 1) != 0
    tl.store(L + b * stride_lb + tok, tl.full([BLOCK], float("-inf"), L.dtype.element_ty), mask=inside & ~allowed)


# -- launch helpers ----------------------------------------------------------------------------------------------


def _pow2(n: int, least: int = 16) -> int:
    """tl.arange needs powers of two; tl.dot needs every dim >= 16."""
    return max(least, triton.next_power_of_2(max(int(n), 1)))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _split_plan(programs: int, max_len: int, device: torch.device, block_n: int, num_splits: int | None):
    """(splits, tokens per split): enough programs to fill every SM about twice, splits of >= 4 tiles.

    max_len is an upper bound on context length taken from the block table's width (no device sync)."""
    if num_splits is None:
        sms = (
            _num_sms(device.index if device.index is not None else torch.cuda.current_device())
            if (device.type == "cuda")
            else 4
        )
        num_splits = max(1, min(-(-2 * sms // max(programs, 1)), -(-max_len // (4 * block_n)), 64))
    per_split = -(-max(max_len, 1) // num_splits)
    per_split = -(-per_split // block_n) * block_n  # whole tiles per split
    return -(-max(max_len, 1) // per_split), per_split


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def _precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs (and interpreted bf16, upcast): exact fp32 dots, not TF32; 16-bit inputs: Triton's default
    return "ieee" if dtype == torch.float32 or _upcast(dtype) else None


def _key_mask_arg(key_mask, like):
    if key_mask is None:
        return like, 0, False  # a dummy pointer, never read (HAS_MASK=False)
    key_mask = key_mask.view(torch.uint8) if key_mask.dtype == torch.bool else key_mask
    return key_mask, key_mask.stride(0), True


def _reduce(partial_out, partial_lse, out, splits):
    batch, heads, _, d = partial_out.shape
    _split_reduce_kernel[(batch, heads)](
        partial_out,
        partial_lse,
        out,
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        *out.stride()[:2],
        splits,
        D_V=d,
        BLOCK_S=_pow2(splits, 2),
        BLOCK_DV=_pow2(d),
    )


def paged_decode_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    *,
    block_size,
    scale,
    softcap=None,
    sliding_window=None,
    key_mask=None,
    num_splits=None,
    block_n=None,
    num_warps=None,
):
    """query [B, H_q, d_k]; key_cache [slots, H_kv, d_k]; value_cache [slots, H_kv, d_v] -> [B, H_q, d_v].

    num_splits / block_n / num_warps override the launch plan (defaults: see _split_plan; 32 tokens per tile and
    8 warps up to d = 128, else 16: these compile for sm_90 without register spills, checked offline)."""
    batch, heads_q, d_k = query.shape
    heads_kv, d_v = key_cache.shape[1], value_cache.shape[2]
    group = heads_q // heads_kv
    out = query.new_empty(batch, heads_q, d_v)
    if batch == 0:
        return out
    block_n = block_n or (32 if max(d_k, d_v) <= 128 else 16)  # K and V tiles of <= 8 KiB each in fp16
    splits, per_split = _split_plan(
        batch * heads_kv, block_tables.shape[1] * block_size, query.device, block_n, num_splits
    )
    mask, stride_km, has_mask = _key_mask_arg(key_mask, context_lens)
    if splits > 1:
        partial_out = torch.empty(batch, heads_q, splits, d_v, device=query.device, dtype=torch.float32)
        partial_lse = torch.empty(batch, heads_q, splits, device=query.device, dtype=torch.float32)
    else:
        partial_out, partial_lse = out.view(batch, heads_q, 1, d_v), out.view(batch, heads_q, 1, d_v)[..., 0]
    _paged_decode_kernel[(batch, heads_kv, splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        mask,
        out,
        partial_out,
        partial_lse,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        block_tables.stride(0),
        stride_km,
        out.stride(0),
        out.stride(1),
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        float(scale),
        float(softcap or 0.0),
        int(sliding_window or 0),
        per_split,
        PAGE=block_size,
        GROUP=group,
        BLOCK_G=_pow2(group),
        BLOCK_N=block_n,
        D_K=d_k,
        D_V=d_v,
        BLOCK_DK=_pow2(d_k),
        BLOCK_DV=_pow2(d_v),
        HAS_MASK=has_mask,
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=sliding_window is not None,
        SPLIT=splits > 1,
        PREC=_precision(query.dtype),
        UPCAST=_upcast(query.dtype),
        num_warps=num_warps or 8,
    )
    if splits > 1:
        _reduce(partial_out, partial_lse, out, splits)
    return out


def mla_decode(
    q_latent,
    q_rope,
    latent_cache,
    block_tables,
    context_lens,
    *,
    block_size,
    scale,
    key_mask=None,
    num_splits=None,
    num_warps=None,
):
    """q_latent [B, H, d_c], q_rope [B, H, d_r], latent_cache [slots, 1, d_c + d_r] -> [B, H, d_c]."""
    batch, heads, d_c = q_latent.shape
    d_r = q_rope.shape[2]
    out = q_latent.new_empty(batch, heads, d_c)
    if batch == 0:
        return out
    block_h = min(_pow2(heads), 16 if d_c > 256 else 32)  # acc is [BLOCK_H, d_c] fp32 in registers
    block_n = 16 if d_c > 256 else 32
    head_blocks = -(-heads // block_h)
    splits, per_split = _split_plan(
        batch * head_blocks, block_tables.shape[1] * block_size, q_latent.device, block_n, num_splits
    )
    mask, stride_km, has_mask = _key_mask_arg(key_mask, context_lens)
    if splits > 1:
        partial_out = torch.empty(batch, heads, splits, d_c, device=q_latent.device, dtype=torch.float32)
        partial_lse = torch.empty(batch, heads, splits, device=q_latent.device, dtype=torch.float32)
    else:
        partial_out, partial_lse = out.view(batch, heads, 1, d_c), out.view(batch, heads, 1, d_c)[..., 0]
    cache = latent_cache[:, 0]  # [slots, d_c + d_r]
    _mla_decode_kernel[(batch, head_blocks, splits)](
        q_latent,
        q_rope,
        cache,
        block_tables,
        context_lens,
        mask,
        out,
        partial_out,
        partial_lse,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        cache.stride(0),
        block_tables.stride(0),
        stride_km,
        out.stride(0),
        out.stride(1),
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        float(scale),
        per_split,
        heads,
        PAGE=block_size,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        D_C=d_c,
        D_R=d_r,
        BLOCK_DC=_pow2(d_c),
        BLOCK_DR=_pow2(d_r),
        HAS_MASK=has_mask,
        SPLIT=splits > 1,
        PREC=_precision(q_latent.dtype),
        UPCAST=_upcast(q_latent.dtype),
        num_warps=num_warps or (8 if d_c > 256 else 4),
    )
    if splits > 1:
        _reduce(partial_out, partial_lse, out, splits)
    return out


def apply_token_bitmask(logits, bitmask):
    """In place on logits [B, V] (unit last-dim stride) from int32 bitmask [B, W]; returns logits."""
    batch, vocab = logits.shape
    block = 1024
    if batch and vocab:
        _bitmask_kernel[(batch, triton.cdiv(vocab, block))](
            logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=block
        )
    return logits
