"""Attention kernels (installed as hf_attn_patch.kernels): one entry point per op, backend="auto" or explicit.

    paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, *, block_size=None,
                           scale=None, softcap=None, sliding_window=None, key_mask=None, backend="auto",
                           validate=True)                                 torch | triton | flash_attn
    mla_decode(q_latent, q_rope, latent_cache, block_tables, context_lens, *, block_size=None, scale=None,
               key_mask=None, backend="auto", validate=True)               torch | triton
    paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, *,
                            block_size=None, scale=None, causal=True, softcap=None, sliding_window=None,
                            backend="auto", validate=True)                 torch | flash_attn
    apply_token_bitmask(logits, bitmask, *, backend="auto")                torch | triton (in place)

`reference` holds the pure-torch twins (the CPU path and the test oracle); `triton_ops` and `flash` are imported
only when their backend is picked, so importing this package never imports triton or touches CUDA. This folder sits
at the repository root and installs under the hf_attn_patch namespace: a top-level `kernels` would shadow Hugging
Face's own `kernels` package.
"""

from . import reference
from .ops import (
    BACKENDS,
    BackendUnavailableError,
    apply_token_bitmask,
    available_backends,
    mla_decode,
    paged_decode_attention,
    paged_prefill_attention,
)

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
