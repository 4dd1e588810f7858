"""What the conversion makes of each layer, decided from the source's config and the options before any weight is
read: GQA / MQA (KV heads), MLA (latent rank d_c, shared RoPE dims d_r, the export's shape) or latent K/V (key and
value ranks), the output format, and
the choices the options leave to the source (method with per-head q/k norms, reconstruct_steps "auto"), returned as
Target.options (the options are frozen)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..methods.budgets import candidate_grid
from ..export.deepseek_export import check_source, engine_shape
from ..options import ConvertOptions, resolved
from ...models.architectures import AttentionShape
from .source import Source

logger = logging.getLogger(__name__)

STOCK_GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # configs with a native num_key_value_heads
# reconstruct_steps "auto" (the CLI's default): steps per layer when the conversion keeps >= half the source's KV
# values, and below: there the closed form starts further off and 60 steps end with most layers still improving
# (SmolLM2 MQA 3->1 / MLA 25%, held-in teacher KL, docs/research-log.md)
AUTO_RECONSTRUCT_STEPS = (60, 150)


@dataclass
class Target:
    """source_kv: the source's KV heads; d_h: its head dim; kv_share: KV values kept per token / the source's.
    MLA: rope_dim d_r and kv_lora_rank d_c of the conversion (uniform allocation; the budget's split otherwise),
    export_rope: the deepseek_v3 export's RoPE dims (>= rope_dim: zero pairs beyond it)."""

    options: ConvertOptions  # the options with this stage's resolved choices: the later stages read these
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


def auto_reconstruct_steps(kv_share: float) -> int:
    """reconstruct_steps="auto": AUTO_RECONSTRUCT_STEPS[0] when the conversion keeps at least half the source's KV
    values per token (kv_share >= 0.5), AUTO_RECONSTRUCT_STEPS[1] below."""
    return AUTO_RECONSTRUCT_STEPS[0] if kv_share >= 0.5 else AUTO_RECONSTRUCT_STEPS[1]


def resolve_target(source: Source, opts: ConvertOptions) -> Target:
    """The Target, with the resolved options: method (GQA with per-head q/k norms: 'mean', unless the user named
    another: refused) and reconstruct_steps ("auto": by the KV share kept)."""
    config, dims = source.config, source.shape
    arch = dims.arch
    if arch.replaces_stock:
        raise ValueError(f"model_type={config.model_type!r} is already MLA: there is nothing to convert")
    d_h, source_kv = dims.head_dim, dims.kv_heads
    stock_format = opts.format == "stock" or (opts.format == "auto" and opts.to in ("gqa", "mqa")
                                              and config.model_type in STOCK_GQA_TYPES)  # fmt: skip
    if stock_format and config.model_type not in STOCK_GQA_TYPES:
        raise ValueError(f"format='stock' exists for GQA/MQA of {STOCK_GQA_TYPES} only, not {config.model_type!r}")
    if opts.to in ("gqa", "mqa"):
        if source_kv % opts.kv_heads:
            raise ValueError(f"kv_heads={opts.kv_heads} must divide the source's num_key_value_heads={source_kv}")
        if opts.method != "mean" and arch.split_heads(source.layers.attention(source.layers.layer(0))[1]).q_norm is not None:
            if dict(opts.given).get("method") is not None:  # asked for by name: refused before calibrating
                raise ValueError(f"method={opts.method!r} with per-head q/k norms ({config.model_type}) is not "
                                 f"supported: use method='mean'")  # fmt: skip
            logger.warning("%s has per-head q/k norms: the default %r does not apply, using 'mean'",
                           config.model_type, opts.method)  # fmt: skip
            opts = resolved(opts, method="mean")
        share = opts.kv_heads / source_kv
        opts = _resolve_steps(opts, share)
        layerwise = bool(opts.reconstruction.steps or (opts.calibration.propagate and opts.method != "mean"))
        return Target(opts, source_kv, d_h, stock_format, share, opts.method != "mean" or layerwise, layerwise)
    if opts.to == "latent_kv":
        key_rank, value_rank = latent_kv_sizes(opts.kv_budget, opts.key_share, dims)
        share = (key_rank + value_rank) / (2 * source_kv * d_h)
        opts = _resolve_steps(opts, share)
        layerwise = bool(opts.calibration.propagate or opts.reconstruction.steps)
        return Target(opts, source_kv, d_h, False, share, True, layerwise, latent_key_rank=key_rank,
                      latent_value_rank=value_rank)  # fmt: skip
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
    share = (export_rope + kv_lora_rank) / (2 * source_kv * d_h)
    opts = _resolve_steps(opts, share)
    if deepseek:
        check_source(config, rope_dim)
    if opts.rank_allocation == "sensitivity":  # the candidate grid is checked against the budget before calibrating
        candidate_grid(dims, opts.kv_budget, opts.rope_dim)
    layerwise = bool(opts.calibration.propagate or opts.reconstruction.steps)
    return Target(opts, source_kv, d_h, False, share, True, layerwise, rope_dim, kv_lora_rank, export_rope)


def _resolve_steps(opts: ConvertOptions, kv_share: float) -> ConvertOptions:
    if opts.reconstruction.steps != "auto":
        return opts
    steps = auto_reconstruct_steps(kv_share)
    logger.info("reconstruct_steps auto: %d (KV share %.3g)", steps, kv_share)
    return resolved(opts, reconstruct_steps=steps)


def latent_kv_sizes(kv_budget: float, key_share: float, shape: AttentionShape) -> tuple[int, int]:
    """(latent_key_rank, latent_value_rank) per layer: kv_budget x the source's 2 * H_kv * d_h values per token,
    key_share of it for keys; each at least 1 and at most the rank of the map it factors."""
    width = shape.kv_heads * shape.head_dim
    budget = int(round(kv_budget * 2 * width))
    limit = min(width, shape.hidden)
    key_rank = min(limit, max(1, int(round(key_share * budget))))
    value_rank = min(limit, budget - key_rank)
    if value_rank < 1:
        raise ValueError(f"kv_budget={kv_budget} gives {budget} values per token: no room for both latents")
    return key_rank, value_rank


def mla_sizes(opts: ConvertOptions, shape: AttentionShape) -> tuple[int, int]:
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
        raise ValueError(f"kv_budget={opts.kv_budget} gives {budget} values per token: no room beside rope_dim={rope_dim}")
    return rope_dim, budget - rope_dim
