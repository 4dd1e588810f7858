"""Retrieval-aware rank allocation (rank_allocation "retrieval"): the layers whose heads copy from far back keep
their exact form, the others share what is left of the KV budget uniformly (MLA); for latent K/V, the KV heads that
copy keep exact keys and every layer's fitted ranks shrink to pay for them.

Copy heads are found from the source's own behaviour, as DuoAttention / RazorAttention find retrieval heads: the
first SEGMENT tokens of each of the first SAMPLES calibration windows (the source's own samples by default), S, are
fed as S + S, and a head's copy score is the mean attention weight from each second-copy query at position i to
i - SEGMENT + 1, the token that followed the query's earlier copy (chance: 1 / position). A layer holds a copy head
when one of its heads scores above COPY_THRESHOLD. Such a layer is kept exact (methods.budgets.exact_plan: every
RoPE pair and the full [K_nope; V] rank); every other layer gets target.rope_dim RoPE dims and the latent rank that
spends the rest of budget_values(kv_budget) evenly, so the total KV bytes per token stay within the budget.

Per KV head (kv_copy_scores, copy_kv_heads): the max of the scores of the query heads that share a KV head, and the
KV heads above a threshold, best first; what an allocation per KV head needs (the one above works per layer).
"""

from __future__ import annotations

import logging

import torch

from ..methods.budgets import budget_values, exact_plan
from ..options import ConvertOptions
from ..targets.base import LatentChoice, LayerChoice, Target
from .source import Source

logger = logging.getLogger(__name__)

SEGMENT, SAMPLES = 128, 2
COPY_THRESHOLD = 0.3  # SmolLM2-135M: 5 heads above it, in layers 17, 18, 20; all others below 0.18


@torch.no_grad()
def copy_scores(model, segments: torch.Tensor) -> torch.Tensor:
    """[layers, heads]: each head's mean attention weight from the second copy's queries of segments [n, s] fed as
    S + S to the token after the query's earlier copy. The model runs with eager attention (SDPA returns no
    weights), then gets its attention implementation back."""
    seg = segments.shape[1]
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(torch.cat([segments, segments], dim=1).to(model.device), output_attentions=True)
    finally:
        model.set_attn_implementation(before)
    queries = torch.arange(seg, 2 * seg - 1)  # the last query's target would lie outside the first copy
    keys = queries - seg + 1
    return torch.stack([a[:, :, queries, keys].float().mean(dim=(0, 2)).cpu() for a in out.attentions])


def kv_copy_scores(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[layers, kv_heads]: copy_scores [layers, heads] per KV head, the max over the query heads that share it
    (query head h reads KV head h // (heads / kv_heads), as transformers' repeat_kv groups them): a KV head is a copy
    head when any of its query heads copies."""
    if scores.dim() != 2:
        raise ValueError(f"scores: [layers, heads] expected, got {tuple(scores.shape)}")
    heads = scores.shape[1]
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads!r} must be a positive divisor of the {heads} query heads")
    return scores.view(len(scores), kv_heads, heads // kv_heads).amax(dim=-1)


def copy_kv_heads(kv_scores: torch.Tensor, threshold: float = COPY_THRESHOLD) -> list[tuple[int, int]]:
    """(layer, kv_head) of every KV head whose score in kv_scores [layers, kv_heads] (kv_copy_scores) is above
    threshold, best first (ties: lower layer, then lower head first)."""
    if kv_scores.dim() != 2:
        raise ValueError(f"kv_scores: [layers, kv_heads] expected, got {tuple(kv_scores.shape)}")
    flat = kv_scores.flatten()
    order = sorted(range(len(flat)), key=lambda i: (-float(flat[i]), i))
    return [divmod(i, kv_scores.shape[1]) for i in order if float(flat[i]) > threshold]


def retrieval_choices(
    copy_layers: list[int], exact: dict[int, LayerChoice], n_layers: int, total: int, rope_dim: int
) -> list[LayerChoice]:
    """Per layer: exact[l] for the copy layers kept, else rope_dim + the even share of what the exact layers leave
    of `total` KV values per token. copy_layers: best first; a layer is kept exact only while the others keep a
    latent rank >= 1 and the total stays within `total` (a tight budget keeps fewer, or none)."""
    kept: list[int] = []
    for l in copy_layers:
        spent = sum(exact[k].rope_dim + exact[k].rank for k in (*kept, l))
        others = n_layers - len(kept) - 1
        if spent <= total and (not others or (total - spent) // others - rope_dim >= 1):
            kept.append(l)
    others = n_layers - len(kept)
    rank = (total - sum(exact[k].rope_dim + exact[k].rank for k in kept)) // others - rope_dim if others else 0
    if others and rank < 1:
        raise ValueError(
            f"kv_budget: {total} KV values per token leave {n_layers} layers no latent rank beside rope_dim={rope_dim}"
        )
    return [exact[l] if l in kept else LayerChoice(rope_dim, rank) for l in range(n_layers)]


def retrieval_plan(source: Source, opts: ConvertOptions, target: Target, windows: torch.Tensor):
    """(choices, the report's "budgets" section) of the module docstring."""
    model = source.whole()
    try:
        scores = copy_scores(model, windows[:SAMPLES, :SEGMENT])
    finally:
        del model
    best = scores.max(dim=1).values
    copy_layers = [l for l in best.argsort(descending=True).tolist() if float(best[l]) > COPY_THRESHOLD]
    src, split = source.layers, source.shape.arch.split_heads
    exact = {}
    for l in copy_layers:
        plan = exact_plan(split(src.attention(src.layer(l))[1]).cpu(), source.shape)
        exact[l] = LayerChoice(2 * len(plan.components), len(plan.energy), exact=True)
    total = budget_values(source.shape, opts.kv_budget)
    choices = retrieval_choices(copy_layers, exact, source.shape.layers, total, target.rope_dim)
    copy_layers = [l for l, c in enumerate(choices) if c.exact]
    logger.info(
        "retrieval allocation: layers %s exact (copy heads), the others d_r %d + d_c %d",
        copy_layers,
        target.rope_dim,
        next((c.rank for c in choices if not c.exact), 0),
    )
    report = {"allocation": "retrieval", "budget_values_per_token": total, "copy_threshold": COPY_THRESHOLD,
              "values_per_token": sum(c.rope_dim + c.rank for c in choices), "exact_layers": copy_layers,
              "layers": [{"layer": l, "choice": "unconverted (exact MLA)" if c.exact else "mla", "rope_dim": c.rope_dim,
                          "kv_lora_rank": c.rank, "copy_score": round(float(scores[l].max()), 4)}
                         for l, c in enumerate(choices)]}  # fmt: skip
    return choices, report


def latent_retrieval_choices(
    copy_heads: list[tuple[int, int]], uniform: LatentChoice, n_layers: int, head_dim: int, kv_heads: int
) -> list[LatentChoice]:
    """Per layer: its copy KV heads' keys exact (d_h latent dims each) plus fitted key and value ranks that share
    what the exact keys leave of the uniform budget n_layers * (r_k + r_v), in the uniform split's proportion (a
    layer's fitted key rank at most its other heads' dims). A head is kept only while every layer keeps fitted ranks
    >= 1 (a tight budget keeps fewer)."""
    total, per_layer = n_layers * (uniform.key_rank + uniform.value_rank), uniform.key_rank + uniform.value_rank
    kept: list[tuple[int, int]] = []
    for head in copy_heads:
        left = (total - head_dim * (len(kept) + 1)) // n_layers
        if round(left * uniform.key_rank / per_layer) >= 1 and left - round(left * uniform.key_rank / per_layer) >= 1:
            kept.append(head)
    left = (total - head_dim * len(kept)) // n_layers
    key = round(left * uniform.key_rank / per_layer)
    out = []
    for layer in range(n_layers):
        exact = tuple(sorted(g for l, g in kept if l == layer))
        fitted = min(key, (kv_heads - len(exact)) * head_dim)  # the other heads' keys hold at most their own dims
        out.append(LatentChoice(fitted + head_dim * len(exact), left - key, exact))
    return out


def latent_retrieval_plan(source: Source, opts: ConvertOptions, uniform: LatentChoice, windows: torch.Tensor):
    """(choices, the report's "budgets" section) for latent_kv: copy KV heads keep exact keys (module docstring's
    copy scores, taken per KV head), at the uniform allocation's total KV values."""
    model = source.whole()
    try:
        scores = copy_scores(model, windows[:SAMPLES, :SEGMENT])
    finally:
        del model
    shape = source.shape
    per_kv = kv_copy_scores(scores, shape.kv_heads)
    heads = copy_kv_heads(per_kv, COPY_THRESHOLD)
    choices = latent_retrieval_choices(heads, uniform, shape.layers, shape.head_dim, shape.kv_heads)
    exact = [(l, g) for l, c in enumerate(choices) for g in c.exact_key_heads]
    logger.info(
        "retrieval allocation: exact keys for KV heads %s (layer, head); fitted ranks K %d + V %d",
        exact,
        choices[0].key_rank - shape.head_dim * len(choices[0].exact_key_heads),
        choices[0].value_rank,
    )
    report = {"allocation": "retrieval", "copy_threshold": COPY_THRESHOLD, "exact_key_heads": exact,
              "values_per_token": sum(c.key_rank + c.value_rank for c in choices),
              "layers": [{"layer": l, "latent_key_rank": c.key_rank, "latent_value_rank": c.value_rank,
                          "exact_key_heads": list(c.exact_key_heads),
                          "copy_score_per_kv_head": [round(float(x), 4) for x in per_kv[l]]}
                         for l, c in enumerate(choices)]}  # fmt: skip
    return choices, report
