"""flash-attn backend: `flash_attn_with_kvcache(..., block_table=)` for paged decode and
`flash_attn_varlen_func(..., block_table=)` for varlen prefill over the same pages.

Not run in CI (needs CUDA + flash-attn): written against flash-attn 2.6+'s documented Python API; the CUDA tests
of tests/test_kernels.py compare it with the reference when the package is installed. Imported only when the
backend is picked.

Constraints (checked by `unsupported_reason`, which makes "auto" fall back and an explicit request raise):
fp16/bf16 only; d_k == d_v <= 256; K/V caches viewed as [num_blocks, block_size, H_kv, d] with block_size a multiple
of 256 (flash-attn 2's paged-KV requirement) and unit stride on the last dim (views of our head-major K/V
storage qualify: flash-attn reads the block, row and head strides of the tensor; not yet run on a GPU with this
layout); no per-key mask (flash-attn has none: left-padded rows need the Triton or torch backend).
"""

from __future__ import annotations

import torch

PAGE_MULTIPLE = 256


def unsupported_reason(query, key_cache, value_cache, block_size, key_mask=None) -> str | None:
    """Why flash-attn cannot run this call (None: it can). key_cache/value_cache are the flat [slots, H, d] views."""
    if not query.is_cuda:
        return "flash_attn needs CUDA tensors"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"flash_attn needs fp16/bf16, got {query.dtype}"
    if key_cache.shape[-1] != value_cache.shape[-1] or key_cache.shape[-1] > 256:
        return f"flash_attn needs d_k == d_v <= 256, got d_k={key_cache.shape[-1]}, d_v={value_cache.shape[-1]}"
    if block_size % PAGE_MULTIPLE:
        return f"flash_attn's paged KV needs block_size % {PAGE_MULTIPLE} == 0, got block_size={block_size}"
    if key_mask is not None:
        return "flash_attn has no per-key mask (key_mask)"
    return None


def _window(sliding_window):
    # ours: the query at p sees keys > p - w; flash-attn: keys in [p - left, p + right]
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


def paged_decode_attention(
    query, key_cache, value_cache, block_tables, context_lens, *, block_size, scale, softcap=None, sliding_window=None
):
    """query [B, H_q, d]; key/value_cache [slots, H_kv, d] -> [B, H_q, d]. Not run in CI (needs CUDA + flash-attn)."""
    from flash_attn import flash_attn_with_kvcache

    out = flash_attn_with_kvcache(
        query.unsqueeze(1),  # [B, 1, H_q, d]
        key_cache.unflatten(0, (-1, block_size)),  # [num_blocks, block_size, H_kv, d], a view
        value_cache.unflatten(0, (-1, block_size)),
        cache_seqlens=context_lens.to(torch.int32),
        block_table=block_tables.to(torch.int32),
        softmax_scale=scale,
        causal=True,  # one query at ctx - 1: every key < ctx is visible either way
        window_size=_window(sliding_window),
        softcap=float(softcap or 0.0),
    )
    return out.squeeze(1)


def paged_prefill_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    *,
    block_size,
    scale,
    causal=True,
    softcap=None,
    sliding_window=None,
):
    """query [total_q, H_q, d] -> [total_q, H_q, d]; bottom-right causal as ours. Not run in CI (needs CUDA +
    flash-attn)."""
    from flash_attn import flash_attn_varlen_func

    cu_seqlens_k = torch.nn.functional.pad(context_lens.to(torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(
        query,
        key_cache.unflatten(0, (-1, block_size)),
        value_cache.unflatten(0, (-1, block_size)),
        cu_seqlens_q.to(torch.int32),
        cu_seqlens_k,
        int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()),
        int(context_lens.max()),
        softmax_scale=scale,
        causal=causal,
        window_size=_window(sliding_window),
        softcap=float(softcap or 0.0),
        block_table=block_tables.to(torch.int32),
    )
