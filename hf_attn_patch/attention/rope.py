"""Rotary position embeddings on the (cos, sin) a transformers model already computes.

Every model here builds `cos, sin = rotary_emb(x, position_ids)` once per forward, shape [B, T, d_rot], laid out as
`cat(freqs, freqs)`: column i and column i + d_rot/2 hold the angle of frequency pair i. Reusing them keeps every
RoPE variant transformers knows (llama3, yarn, dynamic, ...) exact for our modules too.
"""

from __future__ import annotations

import torch

from ..kv_memory import head_dim


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) with x1, x2 the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first d_rot = cos.shape[-1] dims of x, pass the rest through (GPT-NeoX partial rotary).

    x: [B, H, T, d]; cos, sin: [B, T, d_rot] with d_rot <= d.  x_rot * cos + rotate_half(x_rot) * sin.
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    d_rot = cos.shape[-1]
    if d_rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :d_rot], x[..., d_rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def select_rope_pairs(
    cos: torch.Tensor, sin: torch.Tensor, pair_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the frequency pairs `pair_index` (ints in [0, d_rot/2), repeats allowed) of a [B, T, d_rot] cos/sin.

    Returns [B, T, 2 * len(pair_index)] in the same cat(freqs, freqs) layout. MLA's decoupled RoPE key uses this to
    carry a chosen subset (or, for an exact conversion of a GQA source, H_kv copies) of the source's frequencies.
    """
    cos_half, sin_half = cos[..., pair_index], sin[..., pair_index]
    return torch.cat((cos_half, cos_half), dim=-1), torch.cat((sin_half, sin_half), dim=-1)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with pairs (x0, x1), (x2, x3), ... -> [..., d] as (x0, x2, ..., x1, x3, ...).

    DeepSeek checkpoints store rotary dims interleaved (`rope_interleave=True`); after this permutation the
    rotate_half formula gives bit-identical results to transformers' interleaved RoPE.
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def rotary_dim(config) -> int:
    """RoPE dims per head of a rotary config (GPT-NeoX rotates only a fraction of each head)."""
    return int(head_dim(config) * (config.rope_parameters or {}).get("partial_rotary_factor", 1.0))


# RoPE types whose frequencies change with the sequence length: a module that rotates cached keys itself
# (latent_kv) cannot follow them.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def rope_table(config) -> tuple[tuple[float, ...], float]:
    """(theta_i of each RoPE pair, the cos/sin factor) of a rotary config, as its rotary embedding computes them."""
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        d_rot = rotary_dim(config)
        return tuple(params["rope_theta"] ** (-2 * i / d_rot) for i in range(d_rot // 2)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return tuple(inv_freq.tolist()), float(attention_scaling)
