"""Re-express one stock attention layer as MLA, given which RoPE pairs the shared key keeps and a latent basis.

Source layer (per KV head g, query heads h in g's group): k_g = W_k[g] x, v_g = W_v[g] x, q_h = W_q[h] x, with RoPE
on each head's first d_rot dims as pairs (i, i + d_rot/2), i < d_rot/2.

- Decoupled RoPE key: the selected pairs (g, i) side by side (d_r = 2 * #pairs, rotate_half layout: first elements,
  then second elements). Query head h carries its own pair (i) coefficients where the pair's head is its group g,
  zeros elsewhere: q_rope . k_rope = sum over g's selected pairs of q_h,pair . k_g,pair, rotated by the pair's
  frequency (config `mla_rope_pairs` lists each pair's frequency i).
- Non-RoPE part: every other dim of each head, unrotated (for unselected rotary pairs this drops their rotation:
  the partial-RoPE approximation of MHA2MLA). Dims of frequencies selected for *every* KV head are left out of the
  nope part altogether (so the exact form has d_nope = d_h - d_rot); other selected dims keep zero rows there.
- Latent: c = B^T [W_K_nope; W_V] x with B [rows, r] orthonormal columns (the basis); up-projections B, repeated to
  the query heads of each group. B = identity (or the full-rank SVD factor when rows > hidden) is exact.
- Scale: MLA divides scores by sqrt(d_nope + d_r); the source's own scale is folded into W_q.
- Biases: a K bias on non-RoPE dims adds q.b to every score of a query (softmax ignores it: dropped); a V bias is
  folded into o_proj's bias when there is one (exact), else carried by the latent bias B^T b_v.
"""

from __future__ import annotations

import math

import torch

from ..models.architectures import AttentionWeights, architecture_of, head_dim, rotary_dim


def lift_mla(
    w: AttentionWeights, config, pairs: list[tuple[int, int]], basis: torch.Tensor | None
) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict of a MultiHeadLatentAttention, its config fields) for one layer.

    pairs: (kv_head, frequency) pairs the RoPE key keeps; basis: [rows, r], or None for the exact latent (then dims
    of frequencies kept for every KV head leave the nope part; with a basis d_nope = d_h, the same in every layer).
    """
    arch = architecture_of(config)
    if w.q_norm is not None:
        raise ValueError("MLA from per-head q/k norms (qwen3) is not supported: the norm sits between W_k and RoPE")
    d_h, hidden = head_dim(config), w.q_w.shape[1]
    heads, kv_heads = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
    group = heads // kv_heads
    half = (rotary_dim(config) if arch.rotary else 0) // 2
    f64 = lambda t: None if t is None else t.to(torch.float64)  # noqa: E731 - exact arithmetic, cast back at the end
    q_w, k_w, v_w, o_w = map(f64, (w.q_w, w.k_w, w.v_w, w.o_w))
    q_b, k_b, v_b, o_b = map(f64, (w.q_b, w.k_b, w.v_b, w.o_b))
    q_aug = with_bias_column(q_w, q_b).view(heads, d_h, hidden + 1)
    k_aug = with_bias_column(k_w, k_b).view(kv_heads, d_h, hidden + 1)

    nope, zeroed = _nope_layout(kv_heads, d_h, half, pairs, drop_common=basis is None)
    d_nope, d_r = len(nope), 2 * len(pairs)

    # Queries [H, d_nope + d_r, hidden + 1] and the RoPE-key rows [d_r, hidden + 1].
    scale = w.scaling * math.sqrt(d_nope + d_r)
    q_new = torch.zeros(heads, d_nope + d_r, hidden + 1, dtype=torch.float64)
    k_rope = torch.zeros(d_r, hidden + 1, dtype=torch.float64)
    for p, (g, i) in enumerate(pairs):
        k_rope[p], k_rope[len(pairs) + p] = k_aug[g, i], k_aug[g, i + half]
        for h in range(g * group, (g + 1) * group):
            q_new[h, d_nope + p], q_new[h, d_nope + len(pairs) + p] = q_aug[h, i], q_aug[h, i + half]
    for h in range(heads):
        q_new[h, :d_nope] = q_aug[h, nope]
        q_new[h, zeroed[h // group]] = 0
    q_new = q_new.reshape(-1, hidden + 1) * scale

    # Latent over stacked [K_nope; V] (K biases dropped, see module docstring).
    stacked = stacked_kv(w, config, pairs, drop_common=basis is None)
    k_rows = kv_heads * d_nope
    v_bias = v_b if v_b is not None else torch.zeros(v_w.shape[0], dtype=torch.float64)
    exact = basis is None
    basis = exact_basis(stacked) if exact else basis.to(torch.float64)
    down_w = basis.t() @ stacked
    spec_bias = arch.biases(config)
    if spec_bias[3]:  # fold V's bias into o_proj exactly: attention weights sum to one
        o_bias = o_b + o_w @ v_bias.view(kv_heads, 1, d_h).expand(kv_heads, group, d_h).reshape(-1)
        down_b = torch.zeros(basis.shape[1], dtype=torch.float64)
    else:
        o_bias = None
        full_b = torch.cat((torch.zeros(k_rows, dtype=torch.float64), v_bias))
        down_b = basis.t() @ full_b
        if exact and not torch.allclose(basis @ down_b, full_b, atol=1e-9 * (1 + float(full_b.abs().max()))):
            raise ValueError("exact MLA: the V bias is outside the latent's span and there is no o_proj bias to fold it")
    latent = basis.shape[1]
    k_up, v_up = basis[:k_rows].view(kv_heads, d_nope, latent), basis[k_rows:].view(kv_heads, d_h, latent)
    kv_b = torch.cat((k_up, v_up), dim=1).repeat_interleave(group, dim=0).reshape(-1, latent)

    state = {
        "q_proj.weight": q_new[:, :hidden],
        "kv_a_proj_with_mqa.weight": torch.cat((down_w, k_rope[:, :hidden])),
        "kv_b_proj.weight": kv_b,
        "o_proj.weight": o_w,
    }
    if spec_bias[0]:
        state["q_proj.bias"] = q_new[:, hidden]
    if spec_bias[1] or spec_bias[2]:
        state["kv_a_proj_with_mqa.bias"] = torch.cat((down_b, k_rope[:, hidden]))
    if spec_bias[3]:
        state["o_proj.bias"] = o_bias
    state = {k: v.to(w.q_w.dtype).contiguous() for k, v in state.items()}
    fields = dict(
        kv_lora_rank=latent,
        qk_nope_head_dim=d_nope,
        qk_rope_head_dim=d_r,
        v_head_dim=d_h,
        q_lora_rank=None,
        mla_latent_norm=False,
        mla_rope_pairs=[i for _, i in pairs] if pairs else None,
    )
    return state, fields


def stacked_kv(w: AttentionWeights, config, pairs: list[tuple[int, int]], drop_common: bool = False) -> torch.Tensor:
    """[W_K_nope; W_V] in float64, [H_kv * d_nope + H_kv * d_h, hidden]: the map the latent factors."""
    arch = architecture_of(config)
    d_h = head_dim(config)
    kv_heads, hidden = w.k_w.shape[0] // d_h, w.k_w.shape[1]
    half = (rotary_dim(config) if arch.rotary else 0) // 2
    nope, zeroed = _nope_layout(kv_heads, d_h, half, pairs, drop_common)
    k_nope = w.k_w.to(torch.float64).view(kv_heads, d_h, hidden)[:, nope].clone()
    for g, slots in zeroed.items():
        k_nope[g, slots] = 0
    return torch.cat((k_nope.reshape(-1, hidden), w.v_w.to(torch.float64)))


def _nope_layout(kv_heads: int, d_h: int, half: int, pairs, drop_common: bool) -> tuple[list[int], dict]:
    """Non-RoPE dims of every head, and per KV head the slots among them to zero (its selected RoPE pairs).

    With drop_common, dims of frequencies selected for *every* KV head leave the nope part altogether."""
    selected = {g: {i for gg, i in pairs if gg == g} for g in range(kv_heads)}
    common = set.intersection(*selected.values()) if selected and drop_common else set()
    nope = [d for d in range(d_h) if not (d < 2 * half and d % half in common)]
    zeroed = {g: [s for s, d in enumerate(nope) if d < 2 * half and d % half in selected[g]] for g in selected}
    return nope, zeroed


def exact_basis(stacked: torch.Tensor) -> torch.Tensor:
    """Identity when the stacked map has no more rows than inputs, else its full-rank left singular vectors."""
    rows, hidden = stacked.shape
    if rows <= hidden:
        return torch.eye(rows, dtype=torch.float64)
    return torch.linalg.svd(stacked.to(torch.float64), full_matrices=False)[0]


def all_pairs(config, kv_heads: int) -> list[tuple[int, int]]:
    """Every (kv_head, frequency) pair: the exact RoPE key (d_r = H_kv * d_rot)."""
    arch = architecture_of(config)
    half = (rotary_dim(config) if arch.rotary else 0) // 2
    return [(g, i) for g in range(kv_heads) for i in range(half)]


def with_bias_column(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[out, in] weight and [out] bias -> float64 [out, in + 1] (zeros when there is no bias), so rows move with
    their bias under any linear re-mixing of outputs."""
    weight = weight.to(torch.float64)
    bias = bias.to(torch.float64) if bias is not None else weight.new_zeros(weight.shape[0])
    return torch.cat((weight, bias[:, None]), dim=1)
