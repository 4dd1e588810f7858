"""Balanced latent factors: the same function, a basis of the latent that optimizers can step in.

A latent attention computes y = B (A x) through a latent c = A x (A [r, n] the down projection, B [m, r] the up
projection). Any invertible T [r, r] gives the same product, (B T^-1)(T A), but not the same training: Adam moves
every weight by about lr per step whatever its size. The metric-weighted closed forms leave A and B at very
different scales (SmolLM2 latent K/V: k_a_proj RMS ~1e2, k_b_proj ~3e-4), so one step of lr 2e-5 changes k_b_proj
by ~6% and healing diverges at once.

`balance` picks T so that both factors have the same Gram matrix, diagonal (balanced realization):
    P = A A^T = L L^T,  L^T Q L = W S^2 W^T  with Q = B^T B,  T = S^(1/2) W^T L^-1
    => T P T^T = S = T^-T Q T^-1.
The latent cached per token changes basis, what attention computes does not (up to rounding: the float32
products differ in the last bits). The pairs are what each attention variant declares (variants.py,
`latent_factors`): latent K/V's (k_a_proj, k_b_proj) and (v_a_proj, o_proj's per-head column blocks); MLA's
(kv_a_proj_with_mqa's latent rows, kv_b_proj) where no norm sits on the latent.
"""

from __future__ import annotations

import logging

import torch

from ...attention import VariantAttention
from ...variants import variant_of

logger = logging.getLogger(__name__)


@torch.no_grad()
def balance_transform(down: torch.Tensor, up: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, T^-1) [r, r] balancing down [r, n] against up [m, r] (module docstring), in float64."""
    a, b = down.double(), up.double()
    r = a.shape[0]
    p = a @ a.T
    p = p + eps * p.diagonal().mean().clamp_min(eps) * torch.eye(r, dtype=p.dtype, device=p.device)  # rank-safe
    lower = torch.linalg.cholesky(p)
    q = b.T @ b
    w, s2, _ = torch.linalg.svd(lower.T @ q @ lower)
    s_half = s2.clamp_min(eps).pow(0.25)  # S^(1/2), S = sqrt(s2)
    lower_inv = torch.linalg.inv(lower)
    transform = (s_half[:, None] * w.T) @ lower_inv
    inverse = lower @ (w / s_half[None, :])
    return transform, inverse


def latent_pairs(module) -> list[tuple[torch.nn.Linear, slice, torch.nn.Linear, int]]:
    """(down, rows of down that are the latent, up, blocks) for each latent of an attention module, as its variant
    declares them (variants.py); up's input holds `blocks` copies of the latent's width (latent K/V's o_proj: one
    per query head); none for any other module."""
    return variant_of(module.variant).latent_factors(module) if isinstance(module, VariantAttention) else []


def has_latent_factors(model) -> bool:
    """Whether any attention layer of `model` declares a latent factor pair (what `balance` would change)."""
    return any(latent_pairs(m) for m in model.modules())


@torch.no_grad()
def balance(model) -> int:
    """Rebalance every latent pair of `model`'s attention layers in place (module docstring); the pairs changed.
    Biases stay: a down projection's latent rows carry none, an up projection's bias is outside the product."""
    changed = 0
    for module in model.modules():
        for down, rows, up, heads in latent_pairs(module):
            if down.bias is not None and down.bias[rows].abs().max() > 0:  # c = A x + a: T a would be needed too
                continue
            a = down.weight[rows]
            r = a.shape[0]
            b = up.weight.view(up.out_features, heads, r)  # the heads' blocks share one latent
            transform, inverse = balance_transform(a, b.permute(1, 0, 2).reshape(-1, r))
            down.weight[rows] = (transform @ a.double()).to(a.dtype)
            up.weight.copy_((b.double() @ inverse).reshape(up.out_features, -1).to(b.dtype))
            changed += 1
    logger.info("balanced %d latent factor pairs", changed)
    return changed
