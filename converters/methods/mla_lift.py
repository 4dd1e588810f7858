"""Re-express one stock attention layer as MLA, given the decoupled RoPE key's components and a latent basis.

Source layer (per KV head g, query heads h in g's group): k_g = W_k[g] x, v_g = W_v[g] x, q_h = W_q[h] x, with RoPE
on each head's first d_rot dims as pairs (i, i + d_rot/2), i < d_rot/2. Write pair i of a head as a complex number
k_g,i = a + ib: RoPE multiplies it by e^{i theta_i t}, and the pair's share of a score is Re(conj(q_h,i) k_g,i).

- Decoupled RoPE key: components p = (frequency i, mix m, back u), m, u complex over the KV heads:
      k^_p = sum_g m[g] k_g,i        (one complex number: two real dims, rotated at frequency i)
      k_g,i = sum_{p at i} u[g] k^_p + r_g,i    (u, m are the columns / rows of a basis change; r: what is left)
  A complex scalar commutes with RoPE, so query head h (group g) scores Re(conj(conj(u[g]) q_h,i) k^_p) exactly.
  Picking one (kv_head, frequency) pair is m = u = e_g; a basis change across heads per frequency concentrates the
  positional energy in fewer components (TransMLA's RoRoPE). Layout: rotate_half, all first halves, then second.
- Non-RoPE part: every head's own dims, with each RoPE pair replaced by its remainder r_g,i, unrotated (for pairs
  whose components are not all kept this drops their rotation: the partial-RoPE approximation of MHA2MLA).
  Frequencies whose remainder is zero for every head leave the nope part altogether in the exact form.
- Latent: c = B^T [W_K_nope; W_V] x with B [rows, r] orthonormal columns (the basis); up-projections B, repeated to
  the query heads of each group. B = identity (or the full-rank SVD factor when rows > hidden) is exact.
- Scale: MLA divides scores by sqrt(d_nope + d_r); the source's own scale is folded into W_q.
- Biases: a K bias on non-RoPE dims adds q.b to every score of a query (softmax ignores it: dropped); a V bias is
  folded into o_proj's bias when there is one (exact), else carried by the latent bias B^T b_v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...models.architectures import AttentionShape, AttentionWeights


@dataclass
class RopeComponent:
    """One complex dim of the decoupled RoPE key: k^ = sum_g mix[g] k_g,freq; head g's key holds back[g] k^."""

    freq: int
    mix: torch.Tensor  # complex128 [H_kv]
    back: torch.Tensor  # complex128 [H_kv]

    @classmethod
    def pair(cls, kv_head: int, freq: int, kv_heads: int) -> "RopeComponent":
        """The plain (kv_head, frequency) pair of one head."""
        unit = torch.zeros(kv_heads, dtype=torch.complex128)
        unit[kv_head] = 1
        return cls(freq, unit, unit)


def lift_mla(
    w: AttentionWeights,
    shape: AttentionShape,
    components: list[RopeComponent],
    basis: torch.Tensor | None,
    down: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict of a MultiHeadLatentAttention, its config fields) for one layer.

    components: the decoupled RoPE key; basis: the up-projection [rows, r], or None for the exact latent (then the
    dims of frequencies with no remainder leave the nope part; with a basis d_nope = d_h, the same in every layer);
    down: [r, rows] with down @ basis = I (default basis^T, for orthonormal columns).
    """
    if w.q_norm is not None:
        raise ValueError("MLA from per-head q/k norms (qwen3) is not supported: the norm sits between W_k and RoPE")
    d_h, hidden = shape.head_dim, w.q_w.shape[1]
    heads, kv_heads = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
    group = heads // kv_heads
    half = shape.half
    f64 = lambda t: None if t is None else t.to(torch.float64)  # noqa: E731 - exact arithmetic, cast back at the end
    v_w, o_w, v_b, o_b = map(f64, (w.v_w, w.o_w, w.v_b, w.o_b))
    q_aug = with_bias_column(w.q_w, w.q_b).view(heads, d_h, hidden + 1)
    k_aug = with_bias_column(w.k_w, w.k_b).view(kv_heads, d_h, hidden + 1)

    k_nope, nope = _nope_keys(k_aug, half, components, drop_common=basis is None)
    d_nope, n_comp = len(nope), len(components)
    d_r = 2 * n_comp

    # Queries [H, d_nope + d_r, hidden + 1] and the RoPE-key rows [d_r, hidden + 1].
    scale = w.scaling * math.sqrt(d_nope + d_r)
    q_new = torch.zeros(heads, d_nope + d_r, hidden + 1, dtype=torch.float64)
    k_rope = torch.zeros(d_r, hidden + 1, dtype=torch.float64)
    q_new[:, :d_nope] = q_aug[:, nope]
    for p, comp in enumerate(components):
        k_c = complex_pair(k_aug, comp.freq, half)  # [H_kv, hidden + 1] complex
        k_hat = comp.mix @ k_c
        k_rope[p], k_rope[n_comp + p] = k_hat.real, k_hat.imag
        coef = comp.back.conj().repeat_interleave(group)  # query head h: conj(back[g(h)])
        q_hat = coef[:, None] * complex_pair(q_aug, comp.freq, half)
        q_new[:, d_nope + p], q_new[:, d_nope + n_comp + p] = q_hat.real, q_hat.imag
    q_new = q_new.reshape(-1, hidden + 1) * scale

    # Latent over stacked [K_nope; V] (K biases dropped, see module docstring).
    stacked = torch.cat((k_nope[..., :hidden].reshape(-1, hidden), v_w))
    k_rows = kv_heads * d_nope
    v_bias = v_b if v_b is not None else torch.zeros(v_w.shape[0], dtype=torch.float64)
    exact = basis is None
    basis = exact_basis(stacked) if exact else basis.to(torch.float64)
    down = basis.t() if down is None else down.to(torch.float64)
    down_w = down @ stacked
    spec_bias = shape.biases
    if spec_bias[3]:  # fold V's bias into o_proj exactly: attention weights sum to one
        o_bias = o_b + o_w @ v_bias.view(kv_heads, 1, d_h).expand(kv_heads, group, d_h).reshape(-1)
        down_b = torch.zeros(basis.shape[1], dtype=torch.float64)
    else:
        o_bias = None
        full_b = torch.cat((torch.zeros(k_rows, dtype=torch.float64), v_bias))
        down_b = down @ full_b
        if exact and not torch.allclose(basis @ down_b, full_b, atol=1e-9 * (1 + float(full_b.abs().max()))):
            raise ValueError(
                "exact MLA: the V bias is outside the latent's span and there is no o_proj bias to fold it"
            )
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
        mla_rope_pairs=[c.freq for c in components] or None,
    )
    return state, fields


def stacked_kv(w: AttentionWeights, shape: AttentionShape, components: list[RopeComponent]) -> torch.Tensor:
    """[W_K_nope; W_V] in float64, [H_kv * d_h + H_kv * d_h, hidden]: the map a latent basis factors (d_nope = d_h)."""
    d_h = shape.head_dim
    kv_heads, hidden = w.k_w.shape[0] // d_h, w.k_w.shape[1]
    half = shape.half
    k_aug = with_bias_column(w.k_w, w.k_b).view(kv_heads, d_h, hidden + 1)
    k_nope, _ = _nope_keys(k_aug, half, components, drop_common=False)
    return torch.cat((k_nope[..., :hidden].reshape(-1, hidden), w.v_w.to(torch.float64)))


def complex_pair(aug: torch.Tensor, freq: int, half: int) -> torch.Tensor:
    """Rows of RoPE pair `freq` of every head as complex rows: [heads, d_h, in] -> [heads, in], a + ib."""
    return torch.complex(aug[:, freq], aug[:, freq + half])


def _nope_keys(k_aug: torch.Tensor, half: int, components, drop_common: bool) -> tuple[torch.Tensor, list[int]]:
    """Non-RoPE key rows [H_kv, d_nope, in] (each RoPE pair replaced by its remainder r_g,i) and the head dims kept.

    r_i = (I - sum_{p at i} back_p mix_p^T) k_i over the KV heads. With drop_common, frequencies whose remainder is
    zero for every head leave the nope part."""
    kv_heads = k_aug.shape[0]
    k_nope = k_aug.clone()
    dropped = set()
    for freq in sorted({c.freq for c in components}):
        keep = sum(torch.outer(c.back, c.mix) for c in components if c.freq == freq)
        remainder = torch.eye(kv_heads, dtype=torch.complex128) - keep
        if drop_common and remainder.abs().max() < 1e-9:
            dropped.add(freq)
        r = remainder @ complex_pair(k_aug, freq, half)
        k_nope[:, freq], k_nope[:, freq + half] = r.real, r.imag
    nope = [d for d in range(k_aug.shape[1]) if not (d < 2 * half and d % half in dropped)]
    return k_nope[:, nope], nope


def exact_basis(stacked: torch.Tensor) -> torch.Tensor:
    """Identity when the stacked map has no more rows than inputs, else its full-rank left singular vectors."""
    rows, hidden = stacked.shape
    if rows <= hidden:
        return torch.eye(rows, dtype=torch.float64)
    return torch.linalg.svd(stacked.to(torch.float64), full_matrices=False)[0]


def all_pairs(shape: AttentionShape, kv_heads: int) -> list[RopeComponent]:
    """Every (kv_head, frequency) pair: the exact RoPE key (d_r = H_kv * d_rot)."""
    half = shape.half
    return [RopeComponent.pair(g, i, kv_heads) for g in range(kv_heads) for i in range(half)]


def with_bias_column(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[out, in] weight and [out] bias -> float64 [out, in + 1] (zeros when there is no bias), so rows move with
    their bias under any linear re-mixing of outputs."""
    weight = weight.to(torch.float64)
    bias = bias.to(torch.float64) if bias is not None else weight.new_zeros(weight.shape[0])
    return torch.cat((weight, bias[:, None]), dim=1)
