"""Latent K/V closed form: low-rank keys and values taken before RoPE, each fitted in the metric its error costs.

For one layer with input second moment S = E[x x^T] (calibration), K/V weights W_k, W_v [G*d_h, D]:
    keys    the error e of a pre-RoPE key changes the score of a query q at distance s - t by q^T R(s - t) e, so
            its metric is M_k[g] = E_delta[R(delta)^T Q_g R(delta)],  Q_g = sum over the group's query heads h of
            W_q[h] S W_q[h]^T, delta = s - t spread evenly over [-context, 0] (R: the model's RoPE rotation; a
            frequency that turns many times averages to its pair's mean energy, a slow one keeps its direction);
    values  the error of v_g reaches the output through o_proj: M_v[g] = sum_h W_o[h]^T W_o[h].
With P = M^{1/2} (block diagonal over KV heads), the rank-r fit minimizing E||P (W x - B A x)||^2 is PCA in the
weighted space: U = the top-r eigenvectors of P W S W^T P, A = U^T P W, B = P^{-1} U. Biases stay exact: the
key bias on k_b_proj, the value bias folded into o_proj's (attention probabilities sum to 1).
`exact_key_heads`: KV heads whose keys are kept exactly (copy heads): their d_h rows of W_k join the latent as they
are (B's block is the identity), and the rest of the key rank is fitted to the other heads.
"""

from __future__ import annotations

import torch

from ...models.architectures import AttentionShape, AttentionWeights

DISTANCES = 257  # relative distances the key metric averages over, evenly spaced in [-context, 0]


def rotation(shape: AttentionShape, deltas: torch.Tensor) -> torch.Tensor:
    """[n, d_h, d_h] (float64): the RoPE rotation of one head by each relative distance (pair i is dims i and
    i + d_rot/2, as rotate_half lays them out; dims past d_rot are not rotated)."""
    d, half = shape.head_dim, shape.half
    theta = torch.tensor(shape.frequencies, dtype=torch.float64)
    angle = deltas.double()[:, None] * theta[None]  # [n, d_rot/2]
    cos, sin = angle.cos(), angle.sin()
    out = torch.eye(d, dtype=torch.float64).repeat(len(deltas), 1, 1)
    i = torch.arange(half)
    out[:, i, i], out[:, i + half, i + half] = cos, cos
    out[:, i, i + half], out[:, i + half, i] = -sin, sin
    return out


def _sqrt_pair(m: torch.Tensor, floor: float = 1e-9) -> tuple[torch.Tensor, torch.Tensor]:
    """(M^{1/2}, M^{-1/2}) of a symmetric PSD matrix, eigenvalues floored at floor * the largest."""
    e, v = torch.linalg.eigh(m)
    e = e.clamp_min(floor * float(e.max().clamp_min(1e-300)))
    return (v * e.sqrt()) @ v.T, (v / e.sqrt()) @ v.T


def key_metric(w: AttentionWeights, shape: AttentionShape, input_cov: torch.Tensor, context: int) -> torch.Tensor:
    """M_k [G, d_h, d_h] of the module docstring (input_cov [D + 1, D + 1]: inputs with a constant 1 appended)."""
    d, heads, groups = shape.head_dim, shape.heads, shape.kv_heads
    q_w = w.q_w.double()
    if w.q_b is not None:
        q_w = torch.cat((q_w, w.q_b.double()[:, None]), 1)
    else:
        q_w = torch.cat((q_w, q_w.new_zeros(q_w.shape[0], 1)), 1)
    rot = rotation(shape, -torch.linspace(0, context, DISTANCES)) if shape.rotary_dim else None
    out = []
    for g in range(groups):
        rows = slice(g * (heads // groups) * d, (g + 1) * (heads // groups) * d)
        qg = q_w[rows].view(heads // groups, d, -1)
        q_second = (qg @ input_cov @ qg.transpose(1, 2)).sum(0)  # [d, d]
        out.append(q_second if rot is None else (rot.transpose(1, 2) @ q_second @ rot).mean(0))
    return torch.stack(out)


def value_metric(w: AttentionWeights, shape: AttentionShape) -> torch.Tensor:
    """M_v [G, d_h, d_h]: sum over the group's query heads of W_o[h]^T W_o[h]."""
    d, heads, groups = shape.head_dim, shape.heads, shape.kv_heads
    o = w.o_w.double().view(-1, heads, d).transpose(0, 1)  # [H, D, d]
    per_head = o.transpose(1, 2) @ o  # [H, d, d]
    return per_head.view(groups, heads // groups, d, d).sum(1)


def weighted_low_rank(weight: torch.Tensor, cov: torch.Tensor, metric: torch.Tensor, rank: int):
    """weight [G*d, D], cov [D, D], metric [G, d, d] -> (B [G*d, r], A [r, D], weighted eigenvalues, descending)."""
    root, inv_root = zip(*(_sqrt_pair(m) for m in metric))
    root, inv_root = torch.block_diag(*root), torch.block_diag(*inv_root)
    weighted = root @ weight
    e, v = torch.linalg.eigh(weighted @ cov @ weighted.T)
    u = v[:, -rank:].flip(1) if rank else v[:, :0]
    return inv_root @ u, u.T @ weighted, e.flip(0)


METRICS = ("weighted", "plain")  # plain: unweighted PCA of the K / V outputs (the baseline the metric is measured by)


def latent_kv_layer(
    w: AttentionWeights,
    shape: AttentionShape,
    input_cov: torch.Tensor,
    key_rank: int,
    value_rank: int,
    context: int,
    exact_key_heads: tuple[int, ...] = (),
    metric: str = "weighted",
) -> dict[str, torch.Tensor]:
    """The state dict of one LatentKVAttention layer (module docstring); float64 math, float32 out."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r} is not one of {METRICS}")
    d, heads, groups, hidden = shape.head_dim, shape.heads, shape.kv_heads, shape.hidden
    cov = input_cov[:hidden, :hidden].double()
    k_w, v_w = w.k_w.double(), w.v_w.double()
    exact_rows = [r for g in exact_key_heads for r in range(g * d, (g + 1) * d)]
    if key_rank < len(exact_rows):
        raise ValueError(
            f"latent_key_rank={key_rank} is below the {len(exact_rows)} dims of the exact key heads "
            f"{list(exact_key_heads)}"
        )
    fitted = [g for g in range(groups) if g not in exact_key_heads]
    identity = torch.eye(d, dtype=torch.float64).expand(groups, d, d)
    metric_k = key_metric(w, shape, input_cov.double(), context) if metric == "weighted" else identity
    b_k = k_w.new_zeros(groups * d, key_rank)
    a_k = k_w.new_zeros(key_rank, hidden)
    for i, r in enumerate(exact_rows):  # exact heads: their rows of W_k are latent dims, rebuilt by the identity
        b_k[r, i], a_k[i] = 1.0, k_w[r]
    if fitted and key_rank > len(exact_rows):
        rows = [r for g in fitted for r in range(g * d, (g + 1) * d)]
        b, a, _ = weighted_low_rank(k_w[rows], cov, metric_k[fitted], key_rank - len(exact_rows))
        b_k[rows, len(exact_rows) :], a_k[len(exact_rows) :] = b, a
    b_v, a_v, _ = weighted_low_rank(v_w, cov, value_metric(w, shape) if metric == "weighted" else identity, value_rank)
    o = w.o_w.double().view(hidden, heads, d)
    group_of = torch.arange(heads) // (heads // groups)
    b_v_heads = b_v.view(groups, d, value_rank)[group_of]  # [H, d, r_v]
    o_new = torch.einsum("Dhd,hdr->Dhr", o, b_v_heads).reshape(hidden, heads * value_rank)
    state = {
        "q_proj.weight": w.q_w,
        "k_a_proj.weight": a_k,
        "k_b_proj.weight": b_k,
        "v_a_proj.weight": a_v,
        "o_proj.weight": o_new,
    }
    if w.q_b is not None:
        state["q_proj.bias"] = w.q_b
    if w.k_b is not None:
        state["k_b_proj.bias"] = w.k_b
    if w.o_b is not None or w.v_b is not None:
        bias = w.o_b.double() if w.o_b is not None else o.new_zeros(hidden)
        if w.v_b is not None:
            bias = bias + torch.einsum("Dhd,hd->D", o, w.v_b.double().view(groups, d)[group_of])
        state["o_proj.bias"] = bias
    if w.q_norm is not None:
        state["q_norm.weight"], state["k_norm.weight"] = w.q_norm, w.k_norm
    return {k: v.float().contiguous() for k, v in state.items()}
