"""Conversion methods for MLA: how to pick what survives when K/V shrink into a latent.

Both methods keep d_r/2 RoPE pairs in the shared key and a rank-d_c latent; see mla_lift.py for the construction)
- `mha2mla` (Ji et al. 2025, the baseline): pairs with the largest 2-norm contribution mean||q|| * mean||k|| on the
  calibration data; latent = top-d_c left singular vectors of the weights [W_K_nope; W_V] (joint SVD, weights only).
  MHA2MLA keeps pairs per head; a DeepSeek-compatible shared key keeps them per (KV head, frequency) instead.
- `calibrated` (activation-aware, ours): the same pair selection; latent = top-d_c principal directions of the
  calibration *outputs* [K_nope; V] = W x, i.e. eigenvectors of W S W^T with S the input covariance (with a bias
  column), so directions the activations never use cost nothing.
"""

from __future__ import annotations

import torch

from ..models.architectures import AttentionWeights, architecture_of, head_dim, rotary_dim
from .calibration import LayerStats
from .mla_lift import lift_mla, stacked_kv, with_bias_column

MLA_METHODS = ("calibrated", "mha2mla")


def select_pairs(stats: LayerStats, n_pairs: int, group: int) -> list[tuple[int, int]]:
    """The n_pairs (kv_head, frequency) pairs with the largest mean||k|| * sum over the group's queries mean||q||."""
    k = stats.k_pair_norm  # [H_kv, d_rot/2]
    q = stats.q_pair_norm.view(k.shape[0], group, -1).sum(1)  # [H_kv, d_rot/2]
    score = (q * k).flatten()
    if n_pairs > score.numel():
        raise ValueError(f"rope_dim={2 * n_pairs} exceeds the {2 * score.numel()} RoPE dims of all KV heads")
    top = torch.topk(score, n_pairs).indices.sort().values.tolist()
    return [divmod(i, k.shape[1]) for i in top]


def mla_layer(method: str, w: AttentionWeights, config, stats: LayerStats, kv_lora_rank: int, rope_dim: int):
    """(state dict, config fields) of one MLA layer by `method`."""
    d_h = head_dim(config)
    heads, kv_heads = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
    pairs = select_pairs(stats, rope_dim // 2, heads // kv_heads) if rope_dim else []
    stacked = stacked_kv(w, config, pairs)  # [W_K_nope; W_V] (d_nope = d_h): the map the latent factors
    if kv_lora_rank > min(stacked.shape):
        raise ValueError(f"kv_lora_rank={kv_lora_rank} exceeds the rank of [W_K_nope; W_V] ({min(stacked.shape)})")
    if method == "mha2mla":
        basis = torch.linalg.svd(stacked, full_matrices=False)[0][:, :kv_lora_rank]
    elif method == "calibrated":
        cov = stacked @ stats.input_cov[:-1, :-1] @ stacked.t()
        basis = torch.linalg.eigh(cov)[1].flip(-1)[:, :kv_lora_rank]  # eigh sorts ascending
    else:
        raise ValueError(f"method={method!r} is not one of {MLA_METHODS}")
    return lift_mla(w, config, pairs, basis)
