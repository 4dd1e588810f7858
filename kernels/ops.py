"""Attention kernels: one public entry point per op, backend="auto" or explicit.

    paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, *, block_size=None,
                           scale=None, softcap=None, sliding_window=None, key_mask=None, backend="auto",
                           validate=True)                                 torch | triton | flash_attn
    mla_decode(q_latent, q_rope, latent_cache, block_tables, context_lens, *, block_size=None, scale=None,
               key_mask=None, backend="auto", validate=True)               torch | triton
    paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, *,
                            block_size=None, scale=None, causal=True, softcap=None, sliding_window=None,
                            backend="auto", validate=True)                 torch | flash_attn
    apply_token_bitmask(logits, bitmask, *, backend="auto")                torch | triton (in place)

Each checks its arguments, then runs one backend. backend="auto" picks, for CUDA tensors, the fastest backend that is
importable and supports the call (paged decode: flash_attn -> triton -> torch; prefill: flash_attn -> torch; MLA
decode and bitmask: triton -> torch) and always "torch" for CPU tensors; a backend that is unavailable is skipped
(logged at debug level). An explicit backend that is unavailable, or that cannot run this call, raises
BackendUnavailableError saying why. Triton and flash-attn are imported only here, when picked: importing this module
imports neither and never touches CUDA.

Explicit backend="triton" also accepts CPU tensors when TRITON_INTERPRET=1 was set before triton was imported
(Triton's interpreter: how the kernels are tested on CPU).

`reference` holds the pure-torch twins (the CPU path and the test oracle). The kernels/ folder sits at the
repository root and installs as hf_attn_patch.kernels, a namespace package (no __init__.py), so the entry points are
imported from here (`from hf_attn_patch.kernels.ops import paged_decode_attention`): a regular package named
`kernels` at the root would shadow Hugging Face's own `kernels` package, which transformers imports, for any Python
started there.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os

import torch

from . import reference

logger = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "apply_token_bitmask",
    "available_backends",
    "mla_decode",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference",
]

BACKENDS = ("auto", "torch", "triton", "flash_attn")
_INT_DTYPES = (torch.int32, torch.int64)


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (not installed, no CUDA, or an unsupported call)."""


def available_backends() -> dict[str, bool]:
    """Which backends are installed (found on the path; nothing is imported, CUDA is not queried)."""
    return {
        "torch": True,
        "triton": importlib.util.find_spec("triton") is not None,
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
    }


def _import_reason(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as error:  # ImportError, or a broken install raising anything at import
        return f"{module} could not be imported ({type(error).__name__}: {error})"
    return None


def _triton_reason(*tensors) -> str | None:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpreted and not all(t.is_cuda for t in tensors):
        return "the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported)"
    if any(t.stride(-1) != 1 for t in tensors):
        return "the triton backend needs unit stride on the last dim of every tensor"
    return _import_reason("hf_attn_patch.kernels.triton_ops")


def _flash_reason(query, key_cache, value_cache, block_size, key_mask) -> str | None:
    if not query.is_cuda:
        return "flash_attn needs CUDA tensors"
    reason = _import_reason("flash_attn")
    if reason is None:
        from . import flash

        reason = flash.unsupported_reason(query, key_cache, value_cache, block_size, key_mask)
    return reason


def _pick(op: str, backend: str, on_cuda: bool, reasons: dict) -> str:
    """reasons: backend -> zero-argument function returning why it cannot run (None: it can), in auto order."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        if not on_cuda:
            return "torch"
        for name, reason in reasons.items():
            why = reason()
            if why is None:
                return name
            logger.debug("%s: backend %r skipped: %s", op, name, why)
        return "torch"
    if backend == "torch":
        return backend
    if backend not in reasons:
        raise ValueError(f"{op} has no backend={backend!r}; choose from {('auto', 'torch', *reasons)}")
    why = reasons[backend]()
    if why is not None:
        raise BackendUnavailableError(f"{op}: backend={backend!r} is unavailable: {why}")
    return backend


# -- argument checks (shapes and dtypes always; values, which need a device sync on CUDA, when validate=True) -----


def _check_index(name: str, tensor: torch.Tensor, dims: int, rows: int | None = None):
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims or tensor.dtype not in _INT_DTYPES:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        dtype = getattr(tensor, "dtype", None)
        raise ValueError(f"{name} must be a {dims}-D int32/int64 tensor, got {shape} {dtype}")
    if rows is not None and tensor.shape[0] != rows:
        raise ValueError(f"{name} has {tensor.shape[0]} rows, expected {rows}")


def _check_same(name: str, tensor: torch.Tensor, like: torch.Tensor, what: str = "query"):
    if tensor.dtype != like.dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype} but {what} has {like.dtype}")
    if tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device} but {what} is on {like.device}")


def _check_options(scale, softcap, sliding_window, default_scale: float) -> float:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap!r} must be positive (or None)")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive integer (or None)")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a positive number (or None)")
    return default_scale if scale is None else float(scale)


def _check_pages(block_tables, context_lens, block_size: int, num_slots: int, key_mask, validate: bool):
    """Values: 0 <= context_lens <= max_blocks * block_size; block ids of used blocks in [0, num_blocks)."""
    batch, max_blocks = block_tables.shape
    if key_mask is not None:
        if key_mask.dim() != 2 or key_mask.shape[0] != batch or key_mask.dtype not in (torch.bool, torch.uint8):
            raise ValueError(f"key_mask must be bool [B={batch}, L], got {tuple(key_mask.shape)} {key_mask.dtype}")
        if key_mask.device != block_tables.device:
            raise ValueError(f"key_mask is on {key_mask.device} but block_tables is on {block_tables.device}")
    if block_tables.device != context_lens.device:
        raise ValueError(f"context_lens is on {context_lens.device} but block_tables is on {block_tables.device}")
    if not validate or batch == 0:
        return
    lo, hi = int(context_lens.min()), int(context_lens.max())
    if lo < 0 or hi > max_blocks * block_size:
        raise ValueError(
            f"context_lens must lie in [0, max_blocks * block_size = {max_blocks * block_size}], got min {lo}, max {hi}"
        )
    if key_mask is not None and key_mask.shape[1] < hi:
        raise ValueError(f"key_mask covers {key_mask.shape[1]} positions but context_lens reaches {hi}")
    used = torch.arange(max_blocks, device=block_tables.device)[None, :] * block_size < context_lens[:, None]
    num_blocks = num_slots // block_size
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        b, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_tables[{b}, {k}] = {int(block_tables[b, k])} is out of range [0, {num_blocks})")


def _check_kv(query, key_cache, value_cache, block_size):
    """-> flat key/value caches [slots, H_kv, d], block_size, H_kv; query [*, H_q, d_k] must match them."""
    if not query.is_floating_point():
        raise ValueError(f"query must be floating point, got {query.dtype}")
    key_cache, block_size = reference.flat_cache(key_cache, block_size, "key_cache")
    value_cache, _ = reference.flat_cache(value_cache, block_size, "value_cache")
    _check_same("key_cache", key_cache, query)
    _check_same("value_cache", value_cache, query)
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
            "must have the same slots and heads"
        )
    heads_q, d_k = query.shape[-2:]
    heads_kv = key_cache.shape[1]
    if key_cache.shape[2] != d_k:
        raise ValueError(f"query has head dim {d_k} but key_cache has {key_cache.shape[2]}")
    if heads_q % heads_kv:
        raise ValueError(f"query heads H_q={heads_q} must be a multiple of the cache's KV heads H_kv={heads_kv}")
    return key_cache, value_cache, block_size


# -- entry points ------------------------------------------------------------------------------------------------


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    key_mask: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Decode attention of one query token per row over paged K/V (GQA/MQA: H_q a multiple of H_kv).

    query [B, H_q, d_k]; key_cache [slots, H_kv, d_k] and value_cache [slots, H_kv, d_v] (views of PagedKVCache's
    storage [slots, H_kv, d_k + d_v]: `s[..., :d_k]`, `s[..., d_k:]`; or 4-D [num_blocks, block_size, H_kv, d]);
    block_tables [B, max_blocks] int (position p of row b is slot block_tables[b, p // bs] * bs + p % bs; a
    per-token slot table is block_size=1); context_lens [B] int (keys 0..ctx-1, query at ctx - 1);
    key_mask [B, L] bool, False hides a key (left padding); scale defaults to 1/sqrt(d_k).
        out[b, h] = softmax_j(cap(scale * q[b, h] . k[b, j, h // G])) @ v[b, j, h // G]   -> [B, H_q, d_v]
    Rows with no visible key give 0. validate=False skips the value checks of block_tables / context_lens
    (they cost a device sync on CUDA).
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [B, H_q, d_k], got {tuple(query.shape)}")
    key_cache, value_cache, block_size = _check_kv(query, key_cache, value_cache, block_size)
    _check_index("block_tables", block_tables, 2, query.shape[0])
    _check_index("context_lens", context_lens, 1, query.shape[0])
    _check_pages(block_tables, context_lens, block_size, key_cache.shape[0], key_mask, validate)
    scale = _check_options(scale, softcap, sliding_window, query.shape[-1] ** -0.5)
    options = dict(block_size=block_size, scale=scale, softcap=softcap, sliding_window=sliding_window)
    name = _pick(
        "paged_decode_attention",
        backend,
        query.is_cuda,
        {
            "flash_attn": lambda: _flash_reason(query, key_cache, value_cache, block_size, key_mask),
            "triton": lambda: _triton_reason(
                query, key_cache, value_cache, block_tables, context_lens, *([] if key_mask is None else [key_mask])
            ),
        },
    )
    if name == "flash_attn":
        from . import flash

        return flash.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, **options)
    if name == "triton":
        from . import triton_ops

        return triton_ops.paged_decode_attention(
            query, key_cache, value_cache, block_tables, context_lens, key_mask=key_mask, **options
        )
    return reference.paged_decode_attention(
        query, key_cache, value_cache, block_tables, context_lens, key_mask=key_mask, **options
    )


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """MLA absorbed decode over latent pages (FlashMLA-style; backends "torch", "triton").

    q_latent [B, H, d_c] (W_UK^T q_nope); q_rope [B, H, d_r]; latent_cache [slots, 1, d_c + d_r] = PagedKVCache's
    MLA storage ([c | k_rope] per token) or 4-D [num_blocks, block_size, 1, d_c + d_r]; block_tables,
    context_lens, key_mask as in paged_decode_attention; scale defaults to 1/sqrt(d_c + d_r) (DeepSeek passes
    1/sqrt(qk_nope_head_dim + qk_rope_head_dim)).
        out[b, h] = softmax_j(scale * (q_latent . c_j + q_rope . k_rope_j)) @ c_j   -> [B, H, d_c] (apply W_UV after)
    """
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(
            f"q_latent [B, H, d_c] and q_rope [B, H, d_r] must agree on B and H, got "
            f"{tuple(q_latent.shape)} and {tuple(q_rope.shape)}"
        )
    if not q_latent.is_floating_point():
        raise ValueError(f"q_latent must be floating point, got {q_latent.dtype}")
    _check_same("q_rope", q_rope, q_latent, "q_latent")
    latent_cache, block_size = reference.flat_cache(latent_cache, block_size, "latent_cache")
    _check_same("latent_cache", latent_cache, q_latent, "q_latent")
    d_c, d_r = q_latent.shape[-1], q_rope.shape[-1]
    if latent_cache.shape[1:] != (1, d_c + d_r):
        raise ValueError(f"latent_cache rows must be [1, d_c + d_r = {d_c + d_r}], got {tuple(latent_cache.shape)}")
    _check_index("block_tables", block_tables, 2, q_latent.shape[0])
    _check_index("context_lens", context_lens, 1, q_latent.shape[0])
    _check_pages(block_tables, context_lens, block_size, latent_cache.shape[0], key_mask, validate)
    scale = _check_options(scale, None, None, (d_c + d_r) ** -0.5)
    options = dict(block_size=block_size, scale=scale, key_mask=key_mask)
    name = _pick(
        "mla_decode",
        backend,
        q_latent.is_cuda,
        {
            "triton": lambda: _triton_reason(
                q_latent, q_rope, latent_cache, block_tables, context_lens, *([] if key_mask is None else [key_mask])
            ),
        },
    )
    if name == "triton":
        from . import triton_ops

        return triton_ops.mla_decode(q_latent, q_rope, latent_cache, block_tables, context_lens, **options)
    return reference.mla_decode(q_latent, q_rope, latent_cache, block_tables, context_lens, **options)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    causal: bool = True,
    softcap: float | None = None,
    sliding_window: int | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Varlen (packed) prefill over paged K/V, the new tokens' K/V already in the pages (backends "torch",
    "flash_attn").

    query [total_q, H_q, d_k], rows cu_seqlens_q[b]:cu_seqlens_q[b+1] belong to sequence b; cu_seqlens_q [B + 1];
    context_lens [B] (keys 0..ctx-1; the T_b queries are the last T_b positions, so query i sits at ctx - T_b + i
    and, causal, sees keys <= that position: bottom-right aligned as flash-attn); caches and block_tables as in
    paged_decode_attention. Returns [total_q, H_q, d_v].
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [total_q, H_q, d_k], got {tuple(query.shape)}")
    key_cache, value_cache, block_size = _check_kv(query, key_cache, value_cache, block_size)
    _check_index("context_lens", context_lens, 1)
    batch = context_lens.shape[0]
    _check_index("block_tables", block_tables, 2, batch)
    _check_index("cu_seqlens_q", cu_seqlens_q, 1, batch + 1)
    _check_pages(block_tables, context_lens, block_size, key_cache.shape[0], None, validate)
    if validate:
        q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        if int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != query.shape[0] or bool((q_lens < 0).any()):
            raise ValueError(f"cu_seqlens_q={cu_seqlens_q.tolist()} must rise from 0 to total_q={query.shape[0]}")
        if bool((q_lens > context_lens).any()):
            raise ValueError(
                f"a sequence has more queries than keys: q lens {q_lens.tolist()}, context_lens {context_lens.tolist()}"
            )
    scale = _check_options(scale, softcap, sliding_window, query.shape[-1] ** -0.5)
    options = dict(block_size=block_size, scale=scale, causal=causal, softcap=softcap, sliding_window=sliding_window)
    name = _pick(
        "paged_prefill_attention",
        backend,
        query.is_cuda,
        {
            "flash_attn": lambda: _flash_reason(query, key_cache, value_cache, block_size, None),
        },
    )
    if name == "flash_attn":
        from . import flash

        return flash.paged_prefill_attention(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, **options
        )
    return reference.paged_prefill_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, **options
    )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """In place: logits[b, 32 * i + j] = -inf unless bit j of bitmask[b, i] is set (llguidance/xgrammar convention,
    LSB first). logits [B, V] float; bitmask int32 [B, >= ceil(V / 32)] (extra bits are ignored). Returns logits."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [B, V] tensor, got {tuple(logits.shape)} {logits.dtype}")
    words = -(-logits.shape[1] // 32)
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be int32 [B, ceil(V / 32)], got {tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask.shape[0] != logits.shape[0] or bitmask.shape[1] < words:
        raise ValueError(
            f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}: "
            f"needs [{logits.shape[0]}, >= {words}]"
        )
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device} but logits is on {logits.device}")
    name = _pick("apply_token_bitmask", backend, logits.is_cuda, {"triton": lambda: _triton_reason(logits, bitmask)})
    if name == "triton":
        from . import triton_ops

        return triton_ops.apply_token_bitmask(logits, bitmask)
    return reference.apply_token_bitmask(logits, bitmask)
