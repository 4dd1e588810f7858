"""latent K/V: metric-weighted low-rank keys and values taken before RoPE (methods.latent_kv_layer) at the layer's
ranks, from kv_budget split by key_share; rank_allocation "retrieval" keeps exact keys for the KV heads that copy
from far back (stages/retrieval.py) and shrinks every layer's fitted ranks to pay for them."""

from __future__ import annotations

import time

from ...models.architectures import AttentionShape
import torch

from ..methods.exact import stock_attention_layers
from ..methods.latent_kv import latent_kv_layer
from ..options.fields import fill
from ..options.registry import register_target
from .base import (
    ConversionTarget,
    LatentChoice,
    LayerConfigs,
    LayerResult,
    Plan,
    Target,
    converted_config,
    resolve_steps,
)

LATENT_KV_METHODS = ("calibrated",)  # the metric-weighted closed form (methods/latent_kv.py)
# defaults, chosen on the held-in criteria (docs/conversion.md, "Latent K/V"): the share of the KV budget spent on
# keys, and the distances the key metric averages over
LATENT_KEY_SHARE = 1 / 3
LATENT_ROPE_CONTEXT = 4096


class LatentKVTarget(ConversionTarget):
    name = variant = "latent_kv"
    methods = LATENT_KV_METHODS

    def check_rank_allocation(self, opts) -> None:
        if opts.rank_allocation not in ("uniform", "retrieval"):
            raise ValueError(
                f"rank_allocation={opts.rank_allocation!r}: to='latent_kv' takes 'uniform' or "
                "'retrieval' (exact keys for the KV heads that copy from far back)"
            )

    def check_budget(self, opts) -> None:
        if opts.kv_budget is None:
            raise ValueError("to='latent_kv' needs kv_budget (the fraction of the source's KV bytes to keep)")
        if not 0 < opts.kv_budget <= 1:
            raise ValueError(f"kv_budget={opts.kv_budget!r} must be a fraction in (0, 1]")
        fill(opts, "key_share", LATENT_KEY_SHARE if opts.key_share is None else opts.key_share)
        if not isinstance(opts.key_share, (int, float)) or not 0 < opts.key_share < 1:
            raise ValueError(f"key_share={opts.key_share!r} must be a fraction in (0, 1)")
        fill(opts, "rope_context", opts.rope_context or LATENT_ROPE_CONTEXT)

    def resolve(self, source, opts, stock_format: bool) -> Target:
        dims = source.shape
        key_rank, value_rank = latent_kv_sizes(opts.kv_budget, opts.key_share, dims)
        share = (key_rank + value_rank) / (2 * dims.kv_heads * dims.head_dim)
        opts = resolve_steps(opts, share)
        layerwise = bool(opts.calibration.propagate or opts.reconstruction.steps)
        return Target(
            opts,
            dims.kv_heads,
            dims.head_dim,
            False,
            share,
            True,
            layerwise,
            latent_key_rank=key_rank,
            latent_value_rank=value_rank,
        )

    def plan(self, tools) -> Plan:
        started = time.perf_counter()
        uniform = LatentChoice(tools.target.latent_key_rank, tools.target.latent_value_rank)
        if tools.opts.rank_allocation != "retrieval":
            return Plan([uniform] * tools.source.shape.layers)
        plan = Plan(*tools.latent_retrieval(uniform))
        plan.seconds = round(time.perf_counter() - started, 3)
        return plan

    def closed_form(self, opts, w, shape, stats, choice) -> LayerResult:
        return LayerResult(
            latent_kv_layer(
                w, shape, stats.input_cov, choice.key_rank, choice.value_rank, opts.rope_context, choice.exact_key_heads
            )
        )

    def layer_configs(self, config, opts, target, choices, half: int) -> LayerConfigs:
        return LayerConfigs(converted_config(config, self.variant, latent_kv_fields(choices)))

    def report(self, opts, target, plan, layers) -> dict:
        return {
            "latent_kv": {
                "key_share": opts.key_share,
                "rope_context": opts.rope_context,
                "latent_key_rank_per_layer": [c.key_rank for c in plan.choices],
                "latent_value_rank_per_layer": [c.value_rank for c in plan.choices],
                "exact_key_heads_per_layer": [list(c.exact_key_heads) for c in plan.choices],
            }
        }

    def card(self, report: dict) -> dict:
        lk = report["latent_kv"]
        ranks = sorted({(k, v) for k, v in zip(lk["latent_key_rank_per_layer"], lk["latent_value_rank_per_layer"])})
        shape = (
            f" Key latent + value latent dims per token per layer {', '.join(f'{k} + {v}' for k, v in ranks)}, "
            "taken before RoPE: keys are rebuilt per KV head and rotated with the source's exact RoPE."
        )
        b = report.get("budgets") or {}
        sections = []
        if b.get("allocation") == "retrieval" and "exact_key_heads" in b:  # copy KV heads' keys exact
            sections = [
                f"Exact keys for the copy heads' KV heads (layer, head) {b['exact_key_heads']}, within the "
                f"same {b['values_per_token']} KV values per token.",
                "",
            ]
        return {"shape": shape, "sections": sections}

    def exact(self, model, shape) -> tuple[dict, dict]:
        """Full ranks (G * d_h each, at most the hidden size): A_k = W_k, B_k = I, A_v = W_v, o_proj with the
        identity up-projection of V folded in (latent_kv_layer with every component kept)."""
        lifted = {}
        for name, m in stock_attention_layers(model).items():
            weights = shape.arch.split_heads(m)
            rank = weights.k_w.shape[0]
            if rank > shape.hidden:
                raise ValueError(
                    f"latent_kv's exact form needs num_key_value_heads*head_dim={rank} <= hidden_size={shape.hidden}"
                )
            cov = torch.eye(shape.hidden + 1, dtype=torch.float64)  # any full-rank input: the fit is exact
            lifted[name] = latent_kv_layer(weights, shape, cov, rank, rank, context=1)
        return lifted, {
            "latent_key_rank": rank,
            "latent_value_rank": rank,
            "num_key_value_heads": rank // shape.head_dim,
        }


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


def latent_kv_fields(choices: list[LatentChoice]) -> dict:
    """Config fields of a latent_kv conversion: one rank each when every layer has the same, else per-layer lists."""
    fields = {}
    for name, values in (
        ("latent_key_rank", [c.key_rank for c in choices]),
        ("latent_value_rank", [c.value_rank for c in choices]),
    ):
        fields[name] = values[0] if len(set(values)) == 1 else values
    return fields


register_target(LatentKVTarget())
