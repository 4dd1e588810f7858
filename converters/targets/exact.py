"""Exact re-expression of a stock model with our attention modules: same function, new parameterization, by the
target's `exact` hook (GQA: the source's own heads; MLA: every RoPE pair and the full latent; latent K/V: full
ranks). Scores and outputs equal the source's up to rounding; the lossy conversions (pooling, truncated bases, RoPE
selection) are the same constructions with less kept."""

from __future__ import annotations

from torch import nn

from ...models.architectures import AttentionShape
from ..methods.exact import rebuild
from ..options.registry import target_names, target_of


def exact_targets() -> dict:
    """variant -> the target that is that attention variant as it is (MQA is GQA with one KV head: no exact form of
    an MHA source)."""
    targets = (target_of(name) for name in target_names())
    return {t.variant: t for t in targets if t.name == t.variant}


def to_variant(model: nn.Module, variant: str) -> nn.Module:
    """A new model computing the same function as `model` with attention_variant `variant` ("gqa" | "mla" |
    "latent_kv").

    The source model is not modified. Needs the patch (import hf_attn_patch) so the new config builds our modules.
    """
    exact = exact_targets()
    if variant not in exact:
        raise ValueError(f"variant={variant!r} is not one of {tuple(exact)}")
    lifted, fields = exact[variant].exact(model, AttentionShape.of(model.config))
    return rebuild(model, variant, fields, lifted)
