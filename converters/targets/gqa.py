"""GQA and MQA (GQA with one KV head): the KV heads merged by `method` (gqa_merge.gqa_layer, grouped by similarity
when `regroup`); written in the stock format of llama-family sources by default."""

from __future__ import annotations

import logging

from ..methods.exact import stock_attention_layers
from ..methods.gqa_merge import GQA_METHODS, gqa_layer
from ..options import resolved
from ..options.fields import fill
from ..options.registry import register_target
from .base import (
    ConversionTarget,
    LayerConfigs,
    LayerResult,
    Target,
    converted_config,
    refuse_allocation,
    resolve_steps,
)

logger = logging.getLogger(__name__)


class GQATarget(ConversionTarget):
    """kv_heads: fixed by the target (MQA: 1), or None: the kv_heads option (required)."""

    variant = "gqa"
    methods = GQA_METHODS
    formats = ("auto", "native", "stock")
    # the model types whose stock config has num_key_value_heads: the stock format, and "auto"'s pick for them
    stock_types = ("llama", "mistral", "qwen2", "qwen3")

    def __init__(self, name: str, kv_heads: int | None = None):
        self.name, self.kv_heads = name, kv_heads

    def check_options(self, opts) -> None:
        if opts.method == "mean" and opts.regroup is not None:  # mean merges KV heads by index: nothing to group
            raise ValueError(f"regroup={opts.regroup!r} applies to method 'aligned' or 'pca', not method='mean'")
        if opts.method != "mean" and opts.regroup is None:
            fill(opts, "regroup", True)
        if self.kv_heads is not None:
            if opts.kv_heads not in (None, self.kv_heads):
                raise ValueError(f"kv_heads={opts.kv_heads!r}: MQA has exactly one KV head")
            fill(opts, "kv_heads", self.kv_heads)
        if opts.kv_heads is None:
            raise ValueError(f"to={self.name!r} needs kv_heads")

    def check_rank_allocation(self, opts) -> None:
        refuse_allocation(opts)  # one KV head count for every layer: nothing to allocate

    def stock_format(self, config, opts) -> bool:
        stock = opts.format == "stock" or (opts.format == "auto" and config.model_type in self.stock_types)
        if stock and config.model_type not in self.stock_types:
            raise ValueError(f"format='stock' exists for GQA/MQA of {self.stock_types} only, not {config.model_type!r}")
        return stock

    def resolve(self, source, opts, stock_format: bool) -> Target:
        config, dims = source.config, source.shape
        source_kv = dims.kv_heads
        if source_kv % opts.kv_heads:
            raise ValueError(f"kv_heads={opts.kv_heads} must divide the source's num_key_value_heads={source_kv}")
        if (
            opts.method != "mean"
            and dims.arch.split_heads(source.layers.attention(source.layers.layer(0))[1]).q_norm is not None
        ):
            if dict(opts.given).get("method") is not None:  # asked for by name: refused before calibrating
                raise ValueError(
                    f"method={opts.method!r} with per-head q/k norms ({config.model_type}) is not "
                    f"supported: use method='mean'"
                )
            logger.warning(
                "%s has per-head q/k norms: the default %r does not apply, using 'mean'", config.model_type, opts.method
            )
            opts = resolved(opts, method="mean")
        share = opts.kv_heads / source_kv
        opts = resolve_steps(opts, share)
        layerwise = bool(opts.reconstruction.steps or (opts.calibration.propagate and opts.method != "mean"))
        return Target(
            opts, source_kv, dims.head_dim, stock_format, share, opts.method != "mean" or layerwise, layerwise
        )

    def closed_form(self, opts, w, shape, stats, choice) -> LayerResult:
        state, groups = gqa_layer(opts.method, w, shape, opts.kv_heads, stats, regroup=opts.regroup)
        return LayerResult(state, groups=groups)

    def relift(self, opts, w, shape, stats, choice, first: LayerResult) -> LayerResult:
        return self.closed_form(opts, w, shape, stats, None)  # the same merge from the converted prefix's statistics

    def layer_configs(self, config, opts, target, choices, half: int) -> LayerConfigs:
        return LayerConfigs(converted_config(config, self.variant, {"num_key_value_heads": opts.kv_heads}))

    def record(self, result, first: LayerResult, final: LayerResult, choice) -> None:
        result.groups.append(final.groups)

    def report(self, opts, target, plan, layers) -> dict:
        return {"kv_heads": {"before": target.source_kv, "after": opts.kv_heads, "groups_per_layer": layers.groups}}

    def card(self, report: dict) -> dict:
        kv = report["kv_heads"]
        return {"shape": f" {kv['after']} KV heads (the source's {kv['before']}).", "sections": []}

    def exact(self, model, shape) -> tuple[dict, dict]:
        """The source's own heads (H_kv = H for MHA sources) in GroupedQueryAttention."""
        if self.kv_heads is not None:
            return super().exact(model, shape)
        lifted = {name: shape.arch.split_heads(m).gqa_state_dict() for name, m in stock_attention_layers(model).items()}
        return lifted, {"num_key_value_heads": next(iter(lifted.values()))["k_proj.weight"].shape[0] // shape.head_dim}


register_target(GQATarget("gqa"))
register_target(GQATarget("mqa", kv_heads=1))  # MQA is GQA with one KV head
