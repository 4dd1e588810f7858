"""MLA: a LatentPlan per layer (methods.plan_layer: the shared RoPE key's components and the latent basis, best
first; for a layer the allocation leaves unconverted, its exact form) lifted at the layer's rank (methods.lift_plan).
Sizes from kv_lora_rank + rope_dim or from kv_budget; per-layer sizes from the allocation (sensitivity, energy,
retrieval); the deepseek_v3 format fits an engine's shapes and keeps one RoPE frequency stride for every layer."""

from __future__ import annotations

import time

import torch

from ...models.architectures import AttentionShape
from ..export.deepseek_export import check_source, engine_shape
from ..export.stock_rope import stock_frequencies
from ..methods.budgets import candidate_grid, exact_plan
from ..methods.exact import stock_attention_layers
from ..methods.mla_lift import all_pairs, lift_mla
from ..methods.mla_plan import MLA_METHODS, LatentPlan, allocate_ranks, lift_plan, plan_layer, ranked_components
from ..options.fields import fill
from ..options.registry import register_target
from .base import (
    ConversionTarget,
    LayerChoice,
    LayerConfigs,
    LayerResult,
    Plan,
    Target,
    converted_config,
    refuse_allocation,
    resolve_steps,
)


class MLATarget(ConversionTarget):
    name = variant = "mla"
    methods = MLA_METHODS
    formats = ("auto", "native", "deepseek_v3")
    # --context long: the RoPE split scored over the served distances, and one rank for every layer (the per-layer
    # sensitivity search costs more than the healing on a CPU; the served deepseek_v3 shape needs one rank anyway)
    long_context = {"rope_context": 4096, "rank_allocation": "uniform"}

    def default_rank_allocation(self, opts) -> str:
        """sensitivity by kv_budget in a native format (measured best, BENCHMARKS.md), else uniform (stock DeepSeek
        has one rank for all layers)."""
        return "sensitivity" if opts.kv_budget is not None and opts.format != "deepseek_v3" else "uniform"

    def check_rank_allocation(self, opts) -> None:
        if opts.kv_budget is None or opts.format == "deepseek_v3":
            refuse_allocation(opts)
        elif opts.rank_allocation == "energy" and opts.method != "calibrated":
            refuse_allocation(opts)

    def check_budget(self, opts) -> None:
        if (opts.kv_lora_rank is None) == (opts.kv_budget is None):
            raise ValueError(
                f"to='mla' needs exactly one of kv_lora_rank={opts.kv_lora_rank!r} and kv_budget={opts.kv_budget!r}"
            )
        if opts.kv_budget is not None and not 0 < opts.kv_budget <= 1:
            raise ValueError(f"kv_budget={opts.kv_budget!r} must be a fraction in (0, 1]")
        if opts.rope_context is None:  # the calibration window (the source's context costs short-range quality:
            fill(opts, "rope_context", opts.calibration.length)  # docs/conversion-methods.md)

    def resolve(self, source, opts, stock_format: bool) -> Target:
        config, dims = source.config, source.shape
        deepseek = opts.format == "deepseek_v3"
        shape = None
        if deepseek:  # before any work: the source, then the engine's shapes
            check_source(config)
            shape = engine_shape(opts.engine, config, opts.kv_budget, opts.kv_lora_rank, opts.rope_dim)
        if shape is None:
            rope_dim, kv_lora_rank = mla_sizes(opts, dims)
            export_rope = rope_dim
        else:  # the conversion keeps at most the source's frequencies; the export pads with zero RoPE pairs
            kv_lora_rank, export_rope = shape
            rope_dim = min(export_rope, dims.rotary_dim)
        share = (export_rope + kv_lora_rank) / (2 * dims.kv_heads * dims.head_dim)
        opts = resolve_steps(opts, share)
        if deepseek:
            check_source(config, rope_dim)
        if opts.rank_allocation == "sensitivity":  # the candidate grid is checked against the budget before calibrating
            candidate_grid(dims, opts.kv_budget, opts.rope_dim)
        layerwise = bool(opts.calibration.propagate or opts.reconstruction.steps)
        return Target(
            opts, dims.kv_heads, dims.head_dim, False, share, True, layerwise, rope_dim, kv_lora_rank, export_rope
        )

    def plan(self, tools) -> Plan:
        source, opts, target = tools.source, tools.opts, tools.target
        n = source.shape.layers
        uniform = [LayerChoice(target.rope_dim, target.kv_lora_rank) for _ in range(n)]
        started = time.perf_counter()
        if opts.rank_allocation == "sensitivity":
            plan = tools.sensitivity()
        elif opts.rank_allocation == "retrieval":  # copy-head layers exact (stages/retrieval.py)
            plan = Plan(*tools.retrieval())
        elif opts.rank_allocation == "energy":
            energies = [
                LatentPlan([], torch.empty(0), torch.empty(0), mla_plan(opts, w, source.shape, stats, c).energy)
                for (_, _, w, stats), c in zip(tools.layer_statistics(), uniform)
            ]
            ranks = allocate_ranks(energies, target.kv_lora_rank * n)
            plan = Plan([LayerChoice(target.rope_dim, r) for r in ranks])
        elif opts.format == "deepseek_v3":  # one component per frequency 0, s, 2s, ...: what a stock RoPE key turns at
            ranked = [
                ranked_components(opts.method, w, source.shape, stats, opts.rope_context)
                for _, _, w, stats in tools.layer_statistics()
            ]
            frequencies, stride = stock_frequencies(ranked, source.shape.half, target.rope_dim // 2)
            plan = Plan(
                [LayerChoice(target.rope_dim, target.kv_lora_rank, frequencies) for _ in range(n)], stride=stride
            )
        else:
            return Plan(uniform)
        plan.seconds = round(time.perf_counter() - started, 3)
        return plan

    def closed_form(self, opts, w, shape, stats, choice) -> LayerResult:
        plan = mla_plan(opts, w, shape, stats, choice)
        state, fields = lift_plan(plan, w, shape, choice.rank)
        return LayerResult(state, plan=plan, fields=fields)

    def relift(self, opts, w, shape, stats, choice, first: LayerResult) -> LayerResult:
        """The same rank and RoPE frequencies from the converted prefix's statistics; an exact layer keeps its plan."""
        if choice.exact:
            plan = first.plan
        else:
            pairs = first.fields["mla_rope_pairs"] or []
            plan = plan_layer(
                opts.method,
                w,
                shape,
                stats,
                choice.rope_dim,
                opts.rope_context,
                frequencies=pairs if choice.rope_dim else None,
            )
        state, fields = lift_plan(plan, w, shape, choice.rank)
        return LayerResult(state, plan=plan, fields=fields)

    def layer_configs(self, config, opts, target, choices, half: int) -> LayerConfigs:
        return MLAConfigs(config, opts, choices, half)

    def record(self, result, first: LayerResult, final: LayerResult, choice) -> None:
        result.retained.append(round(first.plan.retained(choice.rank), 4))

    def report(self, opts, target, plan, layers) -> dict:
        choices = plan.choices
        rope_dims = [c.rope_dim for c in choices]
        return {
            "mla": {
                "kv_lora_rank": target.kv_lora_rank,
                "qk_rope_head_dim": max(rope_dims),
                "qk_rope_head_dim_per_layer": rope_dims,
                "qk_nope_head_dim": layers.config.qk_nope_head_dim,
                "rope_pairs_per_layer": layers.pairs,
                "kv_lora_rank_per_layer": [c.rank for c in choices],
                "retained_energy_per_layer": layers.retained,
            }
        }

    def card(self, report: dict) -> dict:
        mla = report["mla"]
        varies = any(len(set(mla.get(k) or [])) > 1 for k in ("kv_lora_rank_per_layer", "qk_rope_head_dim_per_layer"))
        shape = (
            f" Latent rank {mla['kv_lora_rank']} + RoPE key {mla['qk_rope_head_dim']} dims per token per layer"
            f"{' (the largest; each layer its own, below)' if varies else ''}."
        )
        return {"shape": shape, "sections": _budget_lines(report.get("budgets") or {}) + _deepseek_lines(report)}

    def exact(self, model, shape) -> tuple[dict, dict]:
        """TransMLA's observation made exact: every RoPE pair of every KV head in the decoupled key, the latent
        spanning the stacked non-RoPE K and V exactly (mla_lift.py). DeepSeek is MLA already: its own weights."""
        layers = stock_attention_layers(model, allow_ours=shape.arch.replaces_stock)
        if shape.arch.replaces_stock:
            return {name: m.state_dict() for name, m in layers.items()}, {}
        lifted, fields = {}, {}
        for name, m in layers.items():
            weights = shape.arch.split_heads(m)
            kv_heads = weights.k_w.shape[0] // shape.head_dim
            lifted[name], fields = lift_mla(weights, shape, all_pairs(shape, kv_heads), None)
        return lifted, fields


class MLAConfigs(LayerConfigs):
    """The MLA config grows as the loop goes: each layer adds its kept RoPE frequencies (pairs)."""

    def __init__(self, config, opts, choices: list[LayerChoice], half: int):
        super().__init__(config)
        self.opts, self.choices, self.half = opts, choices, half
        self.pairs, self.last_fields = [None] * len(choices), {}

    def layer(self, i: int, first: LayerResult):
        self.pairs[i], self.last_fields = first.fields["mla_rope_pairs"], first.fields
        return self.final()

    def final(self):
        return converted_config(
            self.config,
            "mla",
            mla_layer_fields(self.last_fields, self.choices, self.pairs, self.opts.rank_allocation, self.half),
        )


def mla_plan(opts, w, shape: AttentionShape, stats, choice: LayerChoice) -> LatentPlan:
    """The layer's LatentPlan from `stats` (the RoPE components ranked once, as every allocation ranks them)."""
    if choice.exact:
        return exact_plan(w, shape)
    ranked = ranked_components(opts.method, w, shape, stats, opts.rope_context) if choice.rope_dim else None
    return plan_layer(
        opts.method, w, shape, stats, choice.rope_dim, opts.rope_context, frequencies=choice.frequencies, ranked=ranked
    )


def mla_layer_fields(last_fields: dict, choices: list[LayerChoice], pairs: list, allocation: str, half: int) -> dict:
    """Config fields of an MLA conversion: lift_plan's (the same for every layer but the RoPE pairs), the largest
    rank and RoPE dims, and the per-layer lists (ranks: allocations but uniform; RoPE dims: sensitivity, retrieval).
    pairs: per layer its kept frequencies (None for a layer not converted yet: a valid multiset of frequencies
    < half, the source's RoPE pairs per head, stands in)."""
    ranks, ropes = [c.rank for c in choices], [c.rope_dim for c in choices]
    fields = dict(last_fields)
    fields["mla_rope_pairs"] = (
        [p if p is not None else sorted(j % half for j in range(r // 2)) for p, r in zip(pairs, ropes)]
        if max(ropes)
        else None
    )
    fields["kv_lora_rank"] = max(ranks)
    fields["qk_rope_head_dim"] = max(ropes)
    if allocation != "uniform":
        fields["mla_kv_lora_ranks"] = ranks
    if allocation in ("sensitivity", "retrieval"):
        fields["mla_qk_rope_head_dims"] = ropes
    return fields


def mla_sizes(opts, shape: AttentionShape) -> tuple[int, int]:
    """(rope_dim, kv_lora_rank) from the options, checked against the source."""
    source_kv, d_h = shape.kv_heads, shape.head_dim
    max_rope = source_kv * shape.rotary_dim
    budget = None if opts.kv_budget is None else int(round(opts.kv_budget * 2 * source_kv * d_h))  # values/token
    default_rope = min(d_h, max_rope) if budget is None else min(d_h, max_rope, 2 * (budget // 6))  # <= 1/3 of it
    rope_dim = opts.rope_dim if opts.rope_dim is not None else default_rope
    if rope_dim > max_rope:
        raise ValueError(f"rope_dim={rope_dim} exceeds the source's {max_rope} RoPE dims (KV heads x rotary dims)")
    if opts.kv_lora_rank is not None:
        return rope_dim, opts.kv_lora_rank
    if budget - rope_dim < 1:
        raise ValueError(
            f"kv_budget={opts.kv_budget} gives {budget} values per token: no room beside rope_dim={rope_dim}"
        )
    return rope_dim, budget - rope_dim


def _budget_lines(b: dict) -> list[str]:
    """The card's account of the per-layer allocation: copy-head layers kept exact, or each layer's measured choice."""
    if b.get("allocation") == "retrieval":  # copy-head layers exact (converters/stages/retrieval.py)
        other = next((c for c in b["layers"] if c["layer"] not in b["exact_layers"]), None)
        return [
            f"Layers {b['exact_layers']} (copy heads) kept exact; the others RoPE + latent dims "
            f"{other and (other['rope_dim'], other['kv_lora_rank'])}.",
            "",
        ]
    if not b:
        return []
    lines = [f"KV budget by measured sensitivity: {b['values_per_token']} of {b['budget_values_per_token']} "
             f"values per token (KL of each layer's choice alone, on {b['windows']} calibration windows).", "",
             "| layer | choice | RoPE dims | latent rank | KL |", "|---:|---|---:|---:|---:|"]  # fmt: skip
    return (
        lines
        + [
            f"| {c['layer']} | {c['choice']} | {c['rope_dim']} | {c['kv_lora_rank']} | {c['kl']:.2e} |"
            for c in b["layers"]
        ]
        + [""]
    )


def _deepseek_lines(report: dict) -> list[str]:
    """The card's account of a deepseek_v3 export: the engine's shape, how exact the export is, RoPE, query LoRA."""
    if report.get("format") != "deepseek_v3":
        return []
    ds = report["deepseek_v3"]
    shape = ds["shape"]
    exact = (
        "exact up to rounding: the latent is scaled so that kv_a_layernorm is linear (fp32 / bf16 weights; "
        "not fp16, nor GGUF f16 or quantizations with fp16 block scales: use --outtype f32 or bf16)"
        if ds["latent_norm"]["mode"] == "linear"
        else "approximate: what follows kv_a_layernorm is fitted by least squares (fp16)"
    )
    lines = [
        f"A stock `DeepseekV3ForCausalLM` (dense layers, no MoE) shaped for {ds['engine']}: kv_lora_rank "
        f"{shape['kv_lora_rank']} + qk_rope_head_dim {shape['qk_rope_head_dim']}; transformers loads it without "
        f"custom code. The export of the conversion is {exact}; KL to it: {ds['kl_to_native_per_token']:.2g} per "
        f"token before healing.",
        "",
    ]
    if not ds["rope"]["exact"]:
        lines += [
            f"RoPE ({ds['rope']['rope_type']}): nearest stock frequencies, largest relative error "
            f"{ds['rope']['max_relative_frequency_error']:.2g}.",
            "",
        ]
    if "q_lora" in ds:
        q = ds["q_lora"]
        lines += [
            f"Its query LoRA of rank {q['rank']} (llama.cpp needs one) adds {q['extra_parameters']:,} "
            f"parameters ({q['extra_fraction_of_model']:.1%}) at KL {q['kl_to_q_proj_per_token']:.1e} per "
            f"token.",
            "",
        ]
    return lines


register_target(MLATarget())
