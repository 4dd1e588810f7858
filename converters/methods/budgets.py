"""KV budgets by measured sensitivity: each layer's shared-RoPE dims and latent rank chosen by their effect on the
model's output, the total KV values per token within the budget exactly.

1. Candidates per layer (`candidate_grid`): values per token s in SIZE_FACTORS x b (b = the uniform per-layer
   share of the budget), each split as d_r RoPE dims + d_c = s - d_r latent dims, d_r in ROPE_FACTORS x the
   default split (one head's d_h, at most a third of s); and "unconverted": the layer's exact MLA form (every
   (KV head, frequency) pair rotated, the full-rank latent of [K_nope; V]: as many values as the source layer
   caches), so the model stays one architecture.
2. Measurement (stages/sensitivity.py, layer-streamed): on the first MEASURE_TOKENS calibration tokens,
   KL(source || source with only layer l replaced by a candidate), per token: the source's residual stream entering
   layer l is carried, every candidate of layer l runs on it, then layers l+1..L-1 are read once for all of them.
3. Choice (`choose`): minimize the summed KL (an additive model of the layers' effects) subject to
   sum_l s_l <= budget, by an exact dynamic program over integer sizes (a multiple-choice knapsack).
The converted model's config carries per-layer `mla_kv_lora_ranks` and `mla_qk_rope_head_dims`; kv_memory reads
them, so the report's bytes are what the saved model caches.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass

import torch

from ...attention import MultiHeadLatentAttention
from ...models.architectures import AttentionShape, AttentionWeights, attention_spec
from .mla_plan import LatentPlan, lift_plan, plan_layer, ranked_components
from .mla_lift import all_pairs, stacked_kv

logger = logging.getLogger(__name__)

SIZE_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # candidate values per token, as multiples of the uniform share
ROPE_FACTORS = (0.5, 1.0, 2.0)  # candidate RoPE dims, as multiples of the default split of that size
MEASURE_TOKENS = 256  # calibration tokens the KL is measured on (the first windows of the calibration set)


@dataclass(frozen=True)
class Candidate:
    """One layer's option: d_r RoPE dims + d_c latent dims per token; exact: the unconverted layer's MLA form."""

    rope_dim: int
    rank: int
    exact: bool = False

    @property
    def values(self) -> int:
        return self.rope_dim + self.rank


def budget_values(shape: AttentionShape, kv_budget: float) -> int:
    """The budget in KV values per token over all layers: floor(kv_budget x the source's values per token)."""
    return math.floor(kv_budget * shape.layers * 2 * shape.kv_heads * shape.head_dim + 1e-9)


def candidate_grid(shape: AttentionShape, kv_budget: float, rope_dim: int | None = None) -> list[Candidate]:
    """The lossy candidates shared by every layer (sizes around the uniform share b; see the module docstring).
    rope_dim: fix d_r instead of measuring it. Raises, naming kv_budget, when no candidate fits the budget."""
    d_h, source_kv = shape.head_dim, shape.kv_heads
    max_rope = source_kv * shape.rotary_dim
    min_rope = 2 if max_rope else 0  # a rotary model keeps some position: every per-layer list stays a list
    max_rank = min(shape.hidden, 2 * source_kv * d_h)  # rank of [K_nope; V] (d_nope = d_h)
    total = budget_values(shape, kv_budget)
    share = total // shape.layers
    if rope_dim is not None and rope_dim > max_rope:
        raise ValueError(f"rope_dim={rope_dim} exceeds the source's {max_rope} RoPE dims (KV heads x rotary dims)")
    if share < min_rope + 1:
        raise ValueError(
            f"kv_budget={kv_budget} gives {total} KV values per token over {shape.layers} "
            f"layers: rank allocation by sensitivity needs at least {min_rope + 1} per layer (or --rank-allocation "
            f"uniform)"
        )
    out = set()
    for factor in SIZE_FACTORS:
        size = max(min_rope + 1, int(round(factor * share)))
        default = min(d_h, max_rope, 2 * (size // 6))
        ropes = [rope_dim] if rope_dim is not None else [2 * int(round(f * default / 2)) for f in ROPE_FACTORS]
        for d_r in ropes:
            d_r = min(max(d_r, min_rope), max_rope)
            if rope_dim is None and d_r == 0 and max_rope:
                continue
            if 1 <= size - d_r <= max_rank:
                out.add(Candidate(d_r, size - d_r))
    if not out or min(c.values for c in out) * shape.layers > total:
        raise ValueError(
            f"kv_budget={kv_budget}: no per-layer RoPE / latent split fits {total} KV values per token "
            f"(rope_dim={rope_dim})"
        )
    return sorted(out, key=lambda c: (c.values, c.rope_dim))


def exact_plan(w: AttentionWeights, shape: AttentionShape) -> LatentPlan:
    """The layer's exact MLA form as a LatentPlan: every (KV head, frequency) pair rotated, the orthonormal
    column basis of [K_nope; V | V bias] at its numerical rank (lift_plan at len(energy) reproduces the layer)."""
    kv_heads = w.k_w.shape[0] // shape.head_dim
    components = all_pairs(shape, kv_heads) if shape.rotary_dim else []
    stacked = stacked_kv(w, shape, components)  # rotated pairs leave zero K_nope rows
    v_bias = torch.zeros(w.v_w.shape[0], dtype=torch.float64) if w.v_b is None else w.v_b.to(torch.float64)
    bias = torch.cat((torch.zeros(stacked.shape[0] - len(v_bias), dtype=torch.float64), v_bias))
    u, sigma, _ = torch.linalg.svd(torch.cat((stacked, bias[:, None]), dim=1), full_matrices=False)
    rank = int((sigma > sigma[0] * max(stacked.shape) * torch.finfo(torch.float64).eps).sum())
    return LatentPlan(components, u[:, :rank], u[:, :rank].t(), sigma[:rank] ** 2)


def choose(options: list[list[tuple[int, float]]], budget: int) -> list[int]:
    """One option index per layer minimizing the summed cost with sum of sizes <= budget.

    options[l]: (size, cost) pairs, sizes non-negative integers. Exact: a dynamic program over the total size,
    best[c] = least cost of the layers so far at total exactly c. Ties go to the smaller total. Raises when even
    the smallest options exceed the budget."""
    if min(map(len, options), default=1) == 0:
        raise ValueError("every layer needs at least one option")
    smallest = sum(min(s for s, _ in layer) for layer in options)
    if smallest > budget:
        raise ValueError(f"budget={budget}: the smallest options already need {smallest}")
    inf = float("inf")
    best = torch.full((budget + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    picks = []
    for layer in options:
        nxt = torch.full_like(best, inf)
        pick = torch.full((budget + 1,), -1, dtype=torch.long)
        for k, (size, cost) in enumerate(layer):
            if size > budget:
                continue
            shifted = torch.full_like(best, inf)
            shifted[size:] = best[: budget + 1 - size] + cost
            better = shifted < nxt
            nxt[better], pick[better] = shifted[better], k
        best = nxt
        picks.append(pick)
    c = int(torch.argmin(best))  # first minimum: the smallest total among equal costs
    chosen = []
    for layer, pick in zip(reversed(options), reversed(picks)):
        k = int(pick[c])
        chosen.append(k)
        c -= layer[k][0]
    return chosen[::-1]


def mla_module(state: dict, fields: dict, config, layer_idx: int, pairs) -> MultiHeadLatentAttention:
    """A MultiHeadLatentAttention holding one lifted layer, to stand in the source model for a measurement."""
    cfg = copy.deepcopy(config)
    cfg.attention_variant = "mla"
    for key, value in fields.items():
        setattr(cfg, key, value)
    cfg.mla_rope_pairs = pairs
    module = MultiHeadLatentAttention(cfg, layer_idx, attention_spec(cfg, layer_idx))
    module.load_state_dict(state, strict=True)
    return module.to(next(iter(state.values())).dtype).eval()


class LayerCandidates:
    """Every candidate of one layer (the shared grid's that fit the layer, then its exact form) and their plans
    (one per RoPE dims, the components ranked once)."""

    def __init__(
        self,
        index: int,
        w: AttentionWeights,
        config,
        shape: AttentionShape,
        stats,
        method: str,
        context: int,
        grid: list[Candidate],
    ):
        self.index, self.w, self.stats, self.method, self.context = index, w, stats, method, context
        self.config, self.shape = config, shape  # config: to build the candidates' modules
        self.exact = exact_plan(w, shape)
        e = self.exact
        self.options = [c for c in grid if c.values < len(e.energy) + len(e.components) * 2] + [
            Candidate(2 * len(e.components), len(e.energy), exact=True)
        ]
        self._plans: dict[int, LatentPlan] = {}
        self._ranked = None

    def plan(self, cand: Candidate) -> LatentPlan:
        if cand.exact:
            return self.exact
        if cand.rope_dim not in self._plans:
            if self._ranked is None and cand.rope_dim:
                self._ranked = ranked_components(self.method, self.w, self.shape, self.stats, self.context)
            self._plans[cand.rope_dim] = plan_layer(
                self.method, self.w, self.shape, self.stats, cand.rope_dim, self.context, ranked=self._ranked
            )
        return self._plans[cand.rope_dim]

    def module(self, k: int) -> MultiHeadLatentAttention:
        """Candidate k as an attention module to stand in the source's decoder layer for a measurement."""
        cand = self.options[k]
        state, fields = lift_plan(self.plan(cand), self.w, self.shape, cand.rank)
        return mla_module(state, fields, self.config, self.index, fields["mla_rope_pairs"])


def allocation_report(
    options: list[list[Candidate]],
    kl: list[list[float]],
    chosen: list[int],
    total: int,
    windows: int,
    cpu_seconds: float,
) -> dict:
    """The report's "budgets" section: the budget, the choice per layer, every measured candidate."""
    picks = [options[l][k] for l, k in enumerate(chosen)]
    used = sum(c.values for c in picks)
    return {
        "allocation": "sensitivity",
        "budget_values_per_token": total,
        "values_per_token": used,
        "budget_bytes_per_token_fp16": 2 * total,
        "bytes_per_token_fp16": 2 * used,
        "windows": windows,
        "summed_kl": sum(kl[l][k] for l, k in enumerate(chosen)),
        "cpu_seconds": round(cpu_seconds, 2),
        "layers": [
            {
                "layer": l,
                "choice": "unconverted (exact MLA)" if c.exact else "mla",
                "rope_dim": c.rope_dim,
                "kv_lora_rank": c.rank,
                "values_per_token": c.values,
                "kl": kl[l][chosen[l]],
            }
            for l, c in enumerate(picks)
        ],
        "measured": [
            [
                {"rope_dim": c.rope_dim, "kv_lora_rank": c.rank, "exact": c.exact, "kl": kl[l][k]}
                for k, c in enumerate(options[l])
            ]
            for l in range(len(kl))
        ],
    }
