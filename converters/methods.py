"""Conversion methods for MLA: which RoPE components the shared key keeps and which latent survives.

Both methods keep d_r/2 complex RoPE components in the shared key and a rank-d_c latent (mla_lift.py builds them).
- `mha2mla` (Ji et al. 2025, the baseline): (KV head, frequency) pairs with the largest 2-norm contribution
  mean||q|| * mean||k|| on the calibration data; latent = top-d_c left singular vectors of the weights
  [W_K_nope; W_V] (joint SVD, weights only). MHA2MLA keeps pairs per head; a DeepSeek-compatible shared key keeps
  them per (KV head, frequency) instead.
- `calibrated` (activation-aware, ours):
  - RoPE (TransMLA's RoRoPE idea, made query-aware): per frequency i, a basis change across the KV heads from the
    eigenvectors of W^1/2 C W^1/2, C[g, g'] = E[k_g,i conj(k_g',i)] (complex covariance of the pair across heads),
    W = diag(sum over g's query heads of E|q_h,i|^2). Component c then carries score energy lambda_c. What a dropped
    component loses is its rotation, worth lambda_c * 2(1 - sinc(theta_i L)) over distances uniform in [0, L]
    (L = the calibration window): slow frequencies barely rotate, so they go to the nope part nearly for free.
    The top components by that loss are kept.
  - Latent: top-d_c principal directions of the calibration *outputs* [K_nope; V] = W x, measured in the metric of
    what consumes them (Palu / CARE-style whitening): M = blockdiag(sum of E[q_h q_h^T] over the queries reading key
    head g; sum of O_h^T O_h over the o_proj columns reading value head g), each family scaled to mean eigenvalue 1
    so K and V count alike. Eigenvectors B of M^1/2 W S W^T M^1/2; down-projection B^T M^1/2, up M^-1/2 B.
    Directions the activations never use, or the consumers never read, cost nothing.
"""

from __future__ import annotations

import torch

from ..models.architectures import AttentionWeights, head_dim, rotary_dim
from .calibration import LayerStats
from .mla_lift import RopeComponent, lift_mla, stacked_kv, with_bias_column

MLA_METHODS = ("calibrated", "mha2mla")


def rotated_components(w: AttentionWeights, config, stats: LayerStats, context: int) -> list[tuple[float, RopeComponent]]:
    """Every RoPE component of the query-weighted basis change across KV heads, with its loss if left unrotated.

    Returns (score, component) for all d_rot/2 * H_kv components, best first (see the module docstring)."""
    d_h = head_dim(config)
    heads, kv_heads = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
    half = rotary_dim(config) // 2
    cov = stats.input_cov.to(torch.complex128)
    q_aug = with_bias_column(w.q_w, w.q_b).view(heads, d_h, -1)
    k_aug = with_bias_column(w.k_w, w.k_b).view(kv_heads, d_h, -1)
    theta = inverse_frequencies(config)
    scored = []
    for i in range(half):
        k_c = torch.complex(k_aug[:, i], k_aug[:, i + half])  # [H_kv, in]
        q_c = torch.complex(q_aug[:, i], q_aug[:, i + half])  # [H, in]
        c = k_c @ cov @ k_c.conj().t()  # [H_kv, H_kv]: E[k_g conj(k_g')]
        q_energy = torch.einsum("hi,ij,hj->h", q_c, cov, q_c.conj()).real.view(kv_heads, -1).sum(1)
        weight = (q_energy + 1e-9 * q_energy.mean() + 1e-300).sqrt()  # W^1/2, kept invertible
        energy, vectors = torch.linalg.eigh(weight[:, None] * c * weight[None, :])
        sensitivity = 2 * (1 - torch.sinc(torch.tensor(theta[i] * context / torch.pi, dtype=torch.float64)))
        for e, vec in zip(energy.tolist(), vectors.t()):  # k^ = vec^H W^1/2 k,  k = W^-1/2 vec k^
            scored.append((e * float(sensitivity), RopeComponent(i, vec.conj() * weight, vec / weight)))
    scored.sort(key=lambda item: -item[0])
    return scored


def inverse_frequencies(config) -> list[float]:
    """theta_i (radians per position) of each RoPE pair i < d_rot/2, as the model's rotary embedding computes them."""
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        d_rot = rotary_dim(config)
        return [params["rope_theta"] ** (-2 * i / d_rot) for i in range(d_rot // 2)]
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config)[0].tolist()


def ranked_components(method: str, w: AttentionWeights, config, stats: LayerStats, context: int):
    """(score, RopeComponent) candidates for the shared RoPE key, best first: raw pairs (mha2mla) or rotated ones."""
    if method == "calibrated":
        return rotated_components(w, config, stats, context)
    k = stats.k_pair_norm  # [H_kv, d_rot/2]
    score = stats.q_pair_norm.view(k.shape[0], -1, k.shape[1]).sum(1) * k
    order = torch.argsort(score.flatten(), descending=True).tolist()
    return [(float(score.flatten()[i]), RopeComponent.pair(*divmod(i, k.shape[1]), k.shape[0])) for i in order]


def mla_layer(method: str, w: AttentionWeights, config, stats: LayerStats, kv_lora_rank: int, rope_dim: int,
              context: int = 256, frequencies: list[int] | None = None):  # fmt: skip
    """(state dict, config fields) of one MLA layer by `method`; context: L of the RoPE sensitivity (calibrated).

    frequencies: keep the best component of each of these frequencies (a stock DeepSeek RoPE key has one per
    frequency) instead of the best rope_dim/2 components overall."""
    if method not in MLA_METHODS:
        raise ValueError(f"method={method!r} is not one of {MLA_METHODS}")
    ranked = [c for _, c in ranked_components(method, w, config, stats, context)] if rope_dim else []
    if rope_dim // 2 > len(ranked):
        raise ValueError(f"rope_dim={rope_dim} exceeds the {2 * len(ranked)} RoPE dims of all KV heads")
    if frequencies is None:
        components = ranked[: rope_dim // 2]
    else:
        components = [next(c for c in ranked if c.freq == f) for f in frequencies]
    components.sort(key=lambda c: c.freq)
    stacked = stacked_kv(w, config, components)  # [W_K_nope; W_V] (d_nope = d_h): the map the latent factors
    if kv_lora_rank > min(stacked.shape):
        raise ValueError(f"kv_lora_rank={kv_lora_rank} exceeds the rank of [W_K_nope; W_V] ({min(stacked.shape)})")
    if method == "mha2mla":
        return lift_mla(w, config, components, torch.linalg.svd(stacked, full_matrices=False)[0][:, :kv_lora_rank])
    root, inverse_root = consumer_metric(w, config, stats)
    cov = root @ stacked @ stats.input_cov[:-1, :-1] @ stacked.t() @ root
    basis = torch.linalg.eigh(cov)[1].flip(-1)[:, :kv_lora_rank]  # eigh sorts ascending
    return lift_mla(w, config, components, inverse_root @ basis, down=basis.t() @ root)


def consumer_metric(w: AttentionWeights, config, stats: LayerStats) -> tuple[torch.Tensor, torch.Tensor]:
    """(M^1/2, M^-1/2) of the metric on the stacked [K_nope; V] rows (module docstring), [2 H_kv d_h] square."""
    d_h = head_dim(config)
    heads, kv_heads = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
    group = heads // kv_heads
    q = with_bias_column(w.q_w, w.q_b).view(heads, d_h, -1)
    o = w.o_w.to(torch.float64).view(-1, heads, d_h)
    reads_k = [sum(q[h] @ stats.input_cov @ q[h].t() for h in range(g * group, (g + 1) * group)) for g in range(kv_heads)]
    reads_v = [sum(o[:, h].t() @ o[:, h] for h in range(g * group, (g + 1) * group)) for g in range(kv_heads)]
    blocks = []
    for family in (reads_k, reads_v):
        mean_eigenvalue = sum(torch.trace(m) for m in family) / (kv_heads * d_h)
        blocks += [m / mean_eigenvalue for m in family]
    roots = [_sqrtm(m) for m in blocks]
    return torch.block_diag(*(r for r, _ in roots)), torch.block_diag(*(r for _, r in roots))


def _sqrtm(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m^1/2, m^-1/2) of a symmetric PSD matrix; eigenvalues floored at 1e-12 of the largest so both exist."""
    e, v = torch.linalg.eigh(m)
    e = e.clamp_min(1e-12 * float(e.max().clamp_min(1e-300)))
    return (v * e.sqrt()) @ v.t(), (v * e.rsqrt()) @ v.t()
