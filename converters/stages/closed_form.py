"""One layer's closed form and the converted decoder layer that holds it.

GQA / MQA: gqa_merge.gqa_layer (the KV heads merged by `method`, grouped by similarity when `regroup`).
latent K/V: methods.latent_kv_layer (metric-weighted low-rank keys and values before RoPE) at the layer's ranks.
MLA: a LatentPlan (methods.plan_layer: the shared RoPE key's components and the latent basis, best first; for a
layer the sensitivity allocation leaves unconverted, its exact form) lifted at the layer's rank (methods.lift_plan).
The same functions recompute the closed form from the converted prefix's statistics (propagated calibration).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ...models.architectures import AttentionShape
from ..methods.budgets import exact_plan
from ..io.calibration import LayerStats
from ..methods.gqa_merge import gqa_layer
from ..methods.latent_kv import latent_kv_layer
from ..methods.mla_plan import LatentPlan, lift_plan, plan_layer, ranked_components
from ..options import ConvertOptions


@dataclass
class LayerChoice:
    """What MLA layer l becomes: rope_dim d_r, rank d_c; frequencies: the RoPE pairs' frequencies the export keeps
    (deepseek_v3, one per pair) or None (the best components overall); exact: the unconverted layer's exact form."""

    rope_dim: int
    rank: int
    frequencies: list[int] | None = None
    exact: bool = False


@dataclass(frozen=True)
class LatentChoice:
    """What latent_kv layer l becomes: key and value latent ranks; exact_key_heads: KV heads whose keys the latent
    keeps exactly (their d_h dims are part of key_rank)."""

    key_rank: int
    value_rank: int
    exact_key_heads: tuple[int, ...] = ()


@dataclass
class LayerResult:
    """The closed form of one layer: its attention state dict; GQA: the merged groups; MLA: the plan, the config
    fields lift_plan gave (mla_rope_pairs: the kept frequencies)."""

    state: dict[str, torch.Tensor]
    groups: list[list[int]] | None = None
    plan: LatentPlan | None = None
    fields: dict = field(default_factory=dict)


def mla_plan(opts: ConvertOptions, w, shape: AttentionShape, stats: LayerStats, choice: LayerChoice) -> LatentPlan:
    """The layer's LatentPlan from `stats` (the RoPE components ranked once, as every allocation ranks them)."""
    if choice.exact:
        return exact_plan(w, shape)
    ranked = ranked_components(opts.method, w, shape, stats, opts.rope_context) if choice.rope_dim else None
    return plan_layer(opts.method, w, shape, stats, choice.rope_dim, opts.rope_context,
                      frequencies=choice.frequencies, ranked=ranked)  # fmt: skip


def closed_form(opts: ConvertOptions, w, shape: AttentionShape, stats: LayerStats | None,
                choice: LayerChoice | None) -> LayerResult:  # fmt: skip
    """The layer's closed form from the source's statistics (GQA 'mean' needs none)."""
    if opts.to == "latent_kv":
        return LayerResult(latent_kv_layer(w, shape, stats.input_cov, choice.key_rank, choice.value_rank,
                                           opts.rope_context, choice.exact_key_heads))  # fmt: skip
    if opts.to != "mla":
        state, groups = gqa_layer(opts.method, w, shape, opts.kv_heads, stats, regroup=opts.regroup)
        return LayerResult(state, groups=groups)
    plan = mla_plan(opts, w, shape, stats, choice)
    state, fields = lift_plan(plan, w, shape, choice.rank)
    return LayerResult(state, plan=plan, fields=fields)


def relifted(opts: ConvertOptions, w, shape: AttentionShape, stats: LayerStats, choice: LayerChoice | None,
             first: LayerResult) -> LayerResult:  # fmt: skip
    """The same conversion (GQA: the same merge; MLA: the same rank and RoPE frequencies) from the converted
    prefix's statistics; an exact layer keeps its plan."""
    if opts.to == "latent_kv":
        return closed_form(opts, w, shape, stats, choice)
    if opts.to != "mla":
        return closed_form(opts, w, shape, stats, None)
    if choice.exact:
        plan = first.plan
    else:
        pairs = first.fields["mla_rope_pairs"] or []
        plan = plan_layer(opts.method, w, shape, stats, choice.rope_dim, opts.rope_context,
                          frequencies=pairs if choice.rope_dim else None)  # fmt: skip
    state, fields = lift_plan(plan, w, shape, choice.rank)
    return LayerResult(state, plan=plan, fields=fields)


def converted_config(config, variant: str, fields: dict):
    """The converted model's config: the source's plus attention_variant and `fields`, validated (rebuilt)."""
    new = copy.deepcopy(config)
    new.attention_variant = variant
    for key, value in fields.items():
        setattr(new, key, value)
    attn = config._attn_implementation
    new = type(new).from_dict(new.to_dict())  # rebuild: validates the variant fields
    new._attn_implementation = attn
    return new


def mla_layer_fields(last_fields: dict, choices: list[LayerChoice], pairs: list, allocation: str,
                     half: int) -> dict:  # fmt: skip
    """Config fields of an MLA conversion: lift_plan's (the same for every layer but the RoPE pairs), the largest
    rank and RoPE dims, and the per-layer lists (ranks: allocations but uniform; RoPE dims: sensitivity, retrieval).
    pairs: per layer its kept frequencies (None for a layer not converted yet: a valid multiset of frequencies
    < half, the source's RoPE pairs per head, stands in)."""
    ranks, ropes = [c.rank for c in choices], [c.rope_dim for c in choices]
    fields = dict(last_fields)
    fields["mla_rope_pairs"] = [p if p is not None else sorted(j % half for j in range(r // 2))
                                for p, r in zip(pairs, ropes)] \
        if max(ropes) else None  # fmt: skip
    fields["kv_lora_rank"] = max(ranks)
    fields["qk_rope_head_dim"] = max(ropes)
    if allocation != "uniform":
        fields["mla_kv_lora_ranks"] = ranks
    if allocation in ("sensitivity", "retrieval"):
        fields["mla_qk_rope_head_dims"] = ropes
    return fields


def latent_kv_fields(choices: list[LatentChoice]) -> dict:
    """Config fields of a latent_kv conversion: one rank each when every layer has the same, else per-layer lists."""
    fields = {}
    for name, values in (("latent_key_rank", [c.key_rank for c in choices]),
                         ("latent_value_rank", [c.value_rank for c in choices])):  # fmt: skip
        fields[name] = values[0] if len(set(values)) == 1 else values
    return fields


def build_layer(source_layer: nn.Module, index: int, config, attn_name: str, attn_state: dict) -> nn.Module:
    """The converted decoder layer `index` (transformers' class, our attention module by config.attention_variant):
    the source layer's weights with its attention replaced by attn_state, in the source layer's dtype and device.
    Built on the meta device and given its tensors: no initialization runs (nor draws from the global RNG)."""
    param = next(source_layer.parameters())
    with torch.device("meta"):
        layer = type(source_layer)(config, index)
    if any(True for _ in layer.buffers()):
        raise ValueError(f"{type(layer).__name__} has buffers, which a converted layer cannot be given")
    state = {k: v for k, v in source_layer.state_dict().items() if not k.startswith(attn_name + ".")}
    state.update({f"{attn_name}.{k}": v for k, v in attn_state.items()})
    state = {k: v.to(device=param.device, dtype=param.dtype) for k, v in state.items()}
    layer.load_state_dict(state, strict=True, assign=True)
    return layer.eval().requires_grad_(False)
