"""Conversion methods for GQA / MQA: how K/V heads merge when there are fewer of them.

- `mean` (Ainslie et al. 2023, the GQA paper's baseline): the K and V projections of each group of consecutive heads
  are averaged; queries and outputs are kept.
- `aligned` (after "Align attention heads before merging them", arXiv 2412.20677): before averaging, each head of a
  group is rotated onto the group's first head on calibration activations (orthogonal Procrustes from the input
  covariance S: W_j S W_0^T). V: any orthogonal R_j, absorbed into o_proj (O_h R_j). K: one 2x2 rotation per RoPE
  frequency pair (rotations in a pair's plane commute with RoPE; a full orthogonal map on non-RoPE dims), absorbed
  into the queries of the heads that used that key head. The average of aligned weights is their least-squares fit
  on the calibration activations. Exact when the heads of a group are such rotations of each other (tested).
"""

from __future__ import annotations

import torch

from ..models.architectures import AttentionWeights, architecture_of, head_dim, rotary_dim
from .calibration import LayerStats
from .mla_lift import with_bias_column

GQA_METHODS = ("mean", "aligned")


def mean_pool(w: AttentionWeights, config, kv_heads: int) -> dict[str, torch.Tensor]:
    """GroupedQueryAttention state dict with each group's K/V heads averaged into one (groups of consecutive heads)."""
    d_h = head_dim(config)
    source_kv = w.k_w.shape[0] // d_h
    if source_kv % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide the source's {source_kv} KV heads")
    merge = source_kv // kv_heads

    def pool(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.view(kv_heads, merge, d_h, *t.shape[1:]).mean(1).reshape(-1, *t.shape[1:])

    pooled = AttentionWeights(w.q_w, pool(w.k_w), pool(w.v_w), w.o_w, w.q_b, pool(w.k_b), pool(w.v_b), w.o_b,
                              w.scaling, w.q_norm, w.k_norm)  # fmt: skip
    return pooled.gqa_state_dict()


def aligned_pool(w: AttentionWeights, config, kv_heads: int, stats: LayerStats) -> dict[str, torch.Tensor]:
    """GroupedQueryAttention state dict: each group's K/V heads rotated onto its first head, then averaged."""
    if w.q_norm is not None:
        raise ValueError("aligned pooling with per-head q/k norms (qwen3) is not supported: use method='mean'")
    d_h = head_dim(config)
    heads, source_kv = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
    if source_kv % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide the source's {source_kv} KV heads")
    half = (rotary_dim(config) if architecture_of(config).rotary else 0) // 2
    plain_dims = list(range(2 * half, d_h))  # non-RoPE dims (partial rotary, or all dims without RoPE)
    cov = stats.input_cov  # [D + 1, D + 1], last row/column: the bias input
    k_aug = with_bias_column(w.k_w, w.k_b).view(source_kv, d_h, -1)
    v_aug = with_bias_column(w.v_w, w.v_b).view(source_kv, d_h, -1)
    q_aug = with_bias_column(w.q_w, w.q_b).view(heads, d_h, -1)
    o_w = w.o_w.to(torch.float64).view(-1, heads, d_h).clone()  # [D, H, d_h]
    per_kv = heads // source_kv  # query heads per source KV head
    merge = source_kv // kv_heads
    for g in range(kv_heads):
        ref = g * merge
        for j in range(ref + 1, ref + merge):
            # V: orthogonal Procrustes, rows v_j R ~ v_ref, i.e. aligned weights R^T W_vj
            r_v = _procrustes(v_aug[j] @ cov @ v_aug[ref].t())
            v_aug[j] = r_v.t() @ v_aug[j]
            r_k = torch.eye(d_h, dtype=torch.float64)
            for i in range(half):  # K: one rotation per RoPE pair (commutes with RoPE)
                dims = [i, i + half]
                r_k[[[dims[0]], [dims[1]]], dims] = _rotation_2d(k_aug[j][dims] @ cov @ k_aug[ref][dims].t())
            if plain_dims:
                r_k[[[d] for d in plain_dims], plain_dims] = _procrustes(
                    k_aug[j][plain_dims] @ cov @ k_aug[ref][plain_dims].t()
                )
            k_aug[j] = r_k.t() @ k_aug[j]
            for h in range(j * per_kv, (j + 1) * per_kv):  # queries follow their key head; outputs their value head
                q_aug[h] = r_k.t() @ q_aug[h]
                o_w[:, h] = o_w[:, h] @ r_v
    merged_k = k_aug.view(kv_heads, merge, d_h, -1).mean(1).reshape(kv_heads * d_h, -1)
    merged_v = v_aug.view(kv_heads, merge, d_h, -1).mean(1).reshape(kv_heads * d_h, -1)
    q_flat = q_aug.reshape(heads * d_h, -1)
    dtype = w.q_w.dtype
    def weight(aug: torch.Tensor) -> torch.Tensor:
        return aug[:, :-1].to(dtype)

    def bias(aug: torch.Tensor, source_bias) -> torch.Tensor | None:
        return None if source_bias is None else aug[:, -1].to(dtype)

    out = AttentionWeights(
        weight(q_flat), weight(merged_k), weight(merged_v), o_w.reshape(-1, heads * d_h).to(dtype),
        bias(q_flat, w.q_b), bias(merged_k, w.k_b), bias(merged_v, w.v_b), w.o_b, w.scaling,
    )
    return out.gqa_state_dict()


def _procrustes(m: torch.Tensor) -> torch.Tensor:
    """Orthogonal R maximizing tr(R^T m), m = A^T B: the R minimizing ||A R - B|| (U V^T of svd(m))."""
    u, _, vh = torch.linalg.svd(m)
    return u @ vh


def _rotation_2d(m: torch.Tensor) -> torch.Tensor:
    """The 2x2 rotation (det +1) maximizing tr(R^T m): angle atan2(m10 - m01, m00 + m11)."""
    theta = torch.atan2(m[1, 0] - m[0, 1], m[0, 0] + m[1, 1])
    c, s = torch.cos(theta), torch.sin(theta)
    return torch.stack((torch.stack((c, -s)), torch.stack((s, c))))
