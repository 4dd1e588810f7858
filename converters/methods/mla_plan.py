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

from dataclasses import dataclass

import torch

from ...models.architectures import AttentionShape, AttentionWeights
from ..io.calibration import LayerStats
from .mla_lift import RopeComponent, complex_pair, lift_mla, stacked_kv, with_bias_column

MLA_METHODS = ("calibrated", "mha2mla")


def rotated_components(
    w: AttentionWeights, shape: AttentionShape, stats: LayerStats, context: int
) -> list[tuple[float, RopeComponent]]:
    """Every RoPE component of the query-weighted basis change across KV heads, with its loss if left unrotated.

    Returns (score, component) for all d_rot/2 * H_kv components, best first (see the module docstring)."""
    d_h = shape.head_dim
    heads, kv_heads = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
    half = shape.half
    cov = stats.input_cov.to(torch.complex128)
    q_aug = with_bias_column(w.q_w, w.q_b).view(heads, d_h, -1)
    k_aug = with_bias_column(w.k_w, w.k_b).view(kv_heads, d_h, -1)
    theta = shape.frequencies
    scored = []
    for i in range(half):
        k_c, q_c = complex_pair(k_aug, i, half), complex_pair(q_aug, i, half)  # [H_kv, in], [H, in]
        c = k_c @ cov @ k_c.conj().t()  # [H_kv, H_kv]: E[k_g conj(k_g')]
        q_energy = torch.einsum("hi,ij,hj->h", q_c, cov, q_c.conj()).real.view(kv_heads, -1).sum(1)
        weight = (q_energy + 1e-9 * q_energy.mean() + 1e-300).sqrt()  # W^1/2, kept invertible
        energy, vectors = torch.linalg.eigh(weight[:, None] * c * weight[None, :])
        sensitivity = 2 * (1 - torch.sinc(torch.tensor(theta[i] * context / torch.pi, dtype=torch.float64)))
        for e, vec in zip(energy.tolist(), vectors.t()):  # k^ = vec^H W^1/2 k,  k = W^-1/2 vec k^
            mix, back = vec.conj() * weight, vec / weight
            size = mix.abs().norm()  # mix of unit norm: k^ at the scale of the source's keys (back x size: exact)
            scored.append((e * float(sensitivity), RopeComponent(i, mix / size, back * size)))
    scored.sort(key=lambda item: -item[0])
    return scored


def ranked_components(method: str, w: AttentionWeights, shape: AttentionShape, stats: LayerStats, context: int):
    """(score, RopeComponent) candidates for the shared RoPE key, best first: raw pairs (mha2mla) or rotated ones."""
    if method == "calibrated":
        return rotated_components(w, shape, stats, context)
    k = stats.k_pair_norm  # [H_kv, d_rot/2]
    score = stats.q_pair_norm.view(k.shape[0], -1, k.shape[1]).sum(1) * k
    order = torch.argsort(score.flatten(), descending=True).tolist()
    return [(float(score.flatten()[i]), RopeComponent.pair(*divmod(i, k.shape[1]), k.shape[0])) for i in order]


@dataclass
class LatentPlan:
    """One layer's MLA conversion before its rank is fixed: the RoPE key and the full latent basis, best first."""

    components: list[RopeComponent]
    up: torch.Tensor  # [rows, n]: up-projection columns
    down: torch.Tensor  # [n, rows]: down-projection rows, down @ up = I
    energy: torch.Tensor  # [n]: what each latent direction keeps (the eigenvalue or squared singular value)

    def retained(self, rank: int) -> float:
        """Fraction of the layer's [K_nope; V] energy that the top `rank` directions keep."""
        return float(self.energy[:rank].sum() / self.energy.sum().clamp_min(1e-300))


def plan_layer(
    method: str,
    w: AttentionWeights,
    shape: AttentionShape,
    stats: LayerStats,
    rope_dim: int,
    context: int = 256,
    frequencies: list[int] | None = None,
    ranked: list | None = None,
) -> LatentPlan:
    """The RoPE components and the full latent basis of one layer by `method`; context: L of the RoPE sensitivity.

    frequencies: keep the best component of each of these frequencies (a stock DeepSeek RoPE key has one per
    frequency; a repeated frequency takes its next best) instead of the best rope_dim/2 components overall.
    ranked: ranked_components(...) when the caller already has it."""
    if method not in MLA_METHODS:
        raise ValueError(f"method={method!r} is not one of {MLA_METHODS}")
    if rope_dim and ranked is None:
        ranked = ranked_components(method, w, shape, stats, context)
    ranked = [c for _, c in ranked] if rope_dim else []
    if rope_dim // 2 > len(ranked):
        raise ValueError(f"rope_dim={rope_dim} exceeds the {2 * len(ranked)} RoPE dims of all KV heads")
    if frequencies is None:
        components = ranked[: rope_dim // 2]
    else:  # a multiset: each entry takes the best component of its frequency not taken yet
        components, free = [], list(ranked)
        for f in frequencies:
            components.append(free.pop(next(j for j, c in enumerate(free) if c.freq == f)))
    components.sort(key=lambda c: c.freq)
    stacked = stacked_kv(w, shape, components)  # [W_K_nope; W_V] (d_nope = d_h): the map the latent factors
    if method == "mha2mla":
        u, sigma, _ = torch.linalg.svd(stacked, full_matrices=False)
        return LatentPlan(components, u, u.t(), sigma**2)
    root, inverse_root = consumer_metric(w, shape, stats)
    energy, vectors = torch.linalg.eigh(root @ stacked @ stats.input_cov[:-1, :-1] @ stacked.t() @ root)
    energy, vectors = energy.flip(0).clamp_min(0), vectors.flip(-1)  # eigh sorts ascending
    return LatentPlan(components, inverse_root @ vectors, vectors.t() @ root, energy)


def lift_plan(plan: LatentPlan, w: AttentionWeights, shape: AttentionShape, kv_lora_rank: int):
    """(state dict, config fields) of one MLA layer keeping the plan's top `kv_lora_rank` latent directions."""
    if kv_lora_rank > len(plan.energy):
        raise ValueError(f"kv_lora_rank={kv_lora_rank} exceeds the rank of [W_K_nope; W_V] ({len(plan.energy)})")
    up, down = balanced(plan.up[:, :kv_lora_rank], plan.down[:kv_lora_rank])
    return lift_mla(w, shape, plan.components, up, down=down)


def balanced(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(up / s, s down) with s_j = sqrt(|up_:j| / |down_j:|): the same map up @ down, each latent direction's
    down row and up column of equal norm. The whitened basis leaves latent rows far larger than the RoPE key rows
    beside them in kv_a_proj (SmolLM2: RMS ~70 vs ~0.3), which gradient steps (reconstruction, healing) cannot
    serve with one step size."""
    s = (up.norm(dim=0) / down.norm(dim=1).clamp_min(1e-300)).sqrt()
    return up / s, down * s[:, None]


def allocate_ranks(plans: list[LatentPlan], total: int, floor: int = 1) -> list[int]:
    """Per-layer ranks summing to `total` that keep the most energy, each layer's counted as a fraction of its own
    total (so every layer weighs the same): the `total` largest normalized eigenvalues over all layers (optimal for
    this separable objective, each layer's spectrum sorted), at least `floor` per layer."""
    limits = [len(p.energy) for p in plans]
    if not floor * len(plans) <= total <= sum(limits):
        raise ValueError(f"a latent budget of {total} dims cannot give {len(plans)} layers {floor}..{limits} each")
    ranks = [floor] * len(plans)
    gains = [
        (float(p.energy[j] / p.energy.sum().clamp_min(1e-300)), layer, j)
        for layer, p in enumerate(plans)
        for j in range(floor, len(p.energy))
    ]
    for _, layer, _ in sorted(gains, reverse=True)[: total - sum(ranks)]:
        ranks[layer] += 1
    return ranks


def consumer_metric(w: AttentionWeights, shape: AttentionShape, stats: LayerStats) -> tuple[torch.Tensor, torch.Tensor]:
    """(M^1/2, M^-1/2) of the metric on the stacked [K_nope; V] rows (module docstring), [2 H_kv d_h] square."""
    d_h = shape.head_dim
    heads, kv_heads = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
    group = heads // kv_heads
    q = with_bias_column(w.q_w, w.q_b).view(heads, d_h, -1)
    o = w.o_w.to(torch.float64).view(-1, heads, d_h)
    reads_k = [
        sum(q[h] @ stats.input_cov @ q[h].t() for h in range(g * group, (g + 1) * group)) for g in range(kv_heads)
    ]
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
