"""The converter target protocol, and the typed results its hooks exchange with the stages.

A target is what `to=` names: the attention each converted layer becomes. Each implements ConversionTarget in a
module of its own (gqa.py: GQA and MQA, mla.py, latent_kv.py) and has one entry in the table (__init__.py); the stages
look the target up once (`target_of(opts.to)`) and call its hooks, in the order a conversion runs:

    formats, long_context
                        the output formats it writes ("auto" picks one; a format it lacks is refused, naming the
                        targets that have it) and the options `--context long` fills in for it
    check_options(opts), default_rank_allocation(opts), check_rank_allocation(opts), check_budget(opts)
                        the target's own option checks and defaults (ConvertOptions calls them on construction)
    stock_format(config, opts)             whether the output is a stock architecture's config (format "stock")
    resolve(source, opts, stock_format) -> Target
                        sizes from the budget, checked against the source before any weight
    plan(tools) -> Plan                    the per-layer choices (tools: the plan stage's passes over the layers)
    closed_form(...), relift(...)          one layer's closed form, and again from the converted prefix's statistics
    layer_configs(config, opts, target, choices, half)
                        the converted config, per layer as the loop goes and at the end (its config fields)
    record(result, first, final, choice)   what the report keeps per layer
    report(opts, target, plan, layers)     the report's section for this target
    card(report) -> {"shape": sentence, "sections": lines}
                        what the model card says of this target's output (kept in the report: hf_attn_patch/hub.py
                        writes the card from the report alone)
    exact(model, shape) -> (layers, fields)
                        the exact full-rank form of a stock model (targets/exact.py: to_variant)

A target's module ends in `register_target(...)` (options/registry.py), which the options read the target list from.
Options name the targets they belong to (`option(targets=...)`), so a flag given to another target is refused by
one check in options/convert_options.py.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch

from ..methods.mla_plan import LatentPlan
from ..options import resolved

logger = logging.getLogger(__name__)

# reconstruct_steps "auto" (the CLI's default): steps per layer when the conversion keeps >= half the source's KV
# values, and below: there the closed form starts further off and 60 steps end with most layers still improving
# (SmolLM2 MQA 3->1 / MLA 25%, held-in teacher KL, docs/research-log.md)
AUTO_RECONSTRUCT_STEPS = (60, 150)


@dataclass
class Target:
    """source_kv: the source's KV heads; d_h: its head dim; kv_share: KV values kept per token / the source's.
    MLA: rope_dim d_r and kv_lora_rank d_c of the conversion (uniform allocation; the budget's split otherwise),
    export_rope: the deepseek_v3 export's RoPE dims (>= rope_dim: zero pairs beyond it)."""

    options: object  # the ConvertOptions with the target stage's resolved choices: the later stages read these
    source_kv: int
    d_h: int
    stock_format: bool
    kv_share: float
    needs_stats: bool  # calibration statistics are used (every method but GQA 'mean' without layerwise fits)
    layerwise: bool  # propagate / reconstruct after the closed forms
    rope_dim: int = 0
    kv_lora_rank: int = 0
    export_rope: int = 0
    latent_key_rank: int = 0  # latent_kv (uniform allocation)
    latent_value_rank: int = 0

    @property
    def format(self) -> str:
        return "stock" if self.stock_format else "native"


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


@dataclass
class Plan:
    """choices: per MLA layer (LatentChoice per latent_kv layer; None for GQA / MQA); budgets: the report's
    "budgets" section (sensitivity); stride: the deepseek_v3 export's frequency stride s; seconds: the first pass's
    wall time (0 when none ran)."""

    choices: list | None
    budgets: dict | None = None
    stride: int | None = None
    seconds: float = 0.0


class ConversionTarget:
    """The protocol (module docstring). `variant`: the attention variant a conversion to it writes; `methods`: its
    methods, the default first; `formats`: the output formats it writes ("auto" picks one); `long_context`: the
    options the long-context recipe (`--context long`, options/presets.py) fills in for it, under the user's own."""

    name: str
    variant: str
    methods: tuple[str, ...]
    formats: tuple[str, ...] = ("auto", "native")
    long_context: dict = {}

    def check_options(self, opts) -> None:
        pass

    def default_rank_allocation(self, opts) -> str:
        return "uniform"

    def check_rank_allocation(self, opts) -> None:
        pass

    def check_budget(self, opts) -> None:
        pass

    def stock_format(self, config, opts) -> bool:
        """Whether the output is written in the source architecture's own config (format "stock", or "auto" where
        the target picks it); a source the stock format cannot express is refused here."""
        return False

    def resolve(self, source, opts, stock_format: bool) -> Target:
        raise NotImplementedError

    def plan(self, tools) -> Plan:
        return Plan(None)

    def closed_form(self, opts, w, shape, stats, choice) -> LayerResult:
        raise NotImplementedError

    def relift(self, opts, w, shape, stats, choice, first: LayerResult) -> LayerResult:
        return self.closed_form(opts, w, shape, stats, choice)

    def layer_configs(self, config, opts, target: Target, choices, half: int) -> "LayerConfigs":
        raise NotImplementedError

    def record(self, result, first: LayerResult, final: LayerResult, choice) -> None:
        pass

    def report(self, opts, target: Target, plan: Plan, layers) -> dict:
        return {}

    def card(self, report: dict) -> dict:
        """What the model card says of this output: "shape", one sentence after the card's first line (what each
        layer caches), and "sections", lines after the quality section (how sizes were chosen, the export)."""
        return {"shape": "", "sections": []}

    def exact(self, model, shape) -> tuple[dict, dict]:
        """({attention module name: state dict of our module}, config fields): the same function as the stock
        `model`, re-expressed at full rank."""
        raise ValueError(f"to={self.name!r} has no exact form: it keeps less than the source")


def refuse_allocation(opts) -> None:
    """Refuse a per-layer allocation where this target has none to make (the messages say what it needs)."""
    if opts.rank_allocation in ("sensitivity", "retrieval"):
        raise ValueError(
            f"rank_allocation={opts.rank_allocation!r} needs to='mla', kv_budget and a native format "
            "(stock DeepSeek has one kv_lora_rank and one qk_rope_head_dim for all layers)"
        )
    if opts.rank_allocation == "energy":
        raise ValueError(
            "rank_allocation='energy' needs to='mla', kv_budget, method='calibrated' and a native "
            "format (stock DeepSeek has one kv_lora_rank)"
        )


class LayerConfigs:
    """The converted config: `layer(i, first)` as the loop reaches layer i (what its layers are built with),
    `final()` once every layer is done. Here: one config for every layer; MLA's grows per layer."""

    def __init__(self, config):
        self.config = config
        self.pairs: list = []  # MLA: per layer, the RoPE frequencies it kept (the report's rope_pairs_per_layer)

    def layer(self, i: int, first: LayerResult):
        return self.config

    def final(self):
        return self.config


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


def auto_reconstruct_steps(kv_share: float) -> int:
    """reconstruct_steps="auto": AUTO_RECONSTRUCT_STEPS[0] when the conversion keeps at least half the source's KV
    values per token (kv_share >= 0.5), AUTO_RECONSTRUCT_STEPS[1] below."""
    return AUTO_RECONSTRUCT_STEPS[0] if kv_share >= 0.5 else AUTO_RECONSTRUCT_STEPS[1]


def resolve_steps(opts, kv_share: float):
    """The options with reconstruct_steps "auto" resolved by the KV share kept."""
    if opts.reconstruction.steps != "auto":
        return opts
    steps = auto_reconstruct_steps(kv_share)
    logger.info("reconstruct_steps auto: %d (KV share %.3g)", steps, kv_share)
    return resolved(opts, reconstruct_steps=steps)
