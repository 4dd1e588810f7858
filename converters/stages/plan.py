"""First pass, for the MLA decisions that need every layer before any is converted:
    sensitivity: per-layer RoPE dims and ranks (or the exact layer) by measured KL, a knapsack over all layers
        (budgets.choose; the measurement in sensitivity.py);
    energy: per-layer ranks keeping the most normalized latent energy (methods.allocate_ranks);
    retrieval: the layers with copy heads exact, the rest uniform (retrieval.py); latent K/V: the copy heads' KV
        heads keep exact keys, every layer's fitted ranks shrink to pay for them;
    deepseek_v3: the RoPE frequencies 0, s, 2s, ... every layer keeps (deepseek_export.stock_frequencies).
The pass streams the source's calibration track, computing each layer's statistics as the second pass will (the
same batches, so the same values), and keeps only what the decisions need (ranked components, energies, KL).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..io.calibration import track_statistics
from ..io.layer_stream import BATCH, LayerRunner, Tracks
from ..methods.budgets import MEASURE_TOKENS, LayerCandidates, allocation_report, budget_values, candidate_grid, choose
from ..export.stock_rope import stock_frequencies
from ..methods.mla_plan import LatentPlan, allocate_ranks, ranked_components
from ..options import ConvertOptions
from .closed_form import LatentChoice, LayerChoice, mla_plan
from .retrieval import latent_retrieval_plan, retrieval_plan
from .source import Source
from .target import Target

logger = logging.getLogger(__name__)


@dataclass
class Plan:
    """choices: per MLA layer (LatentChoice per latent_kv layer; None for GQA / MQA); budgets: the report's "budgets" section (sensitivity);
    stride: the deepseek_v3 export's frequency stride s; seconds: the first pass's wall time (0 when none ran)."""

    choices: list[LayerChoice] | None
    budgets: dict | None = None
    stride: int | None = None
    seconds: float = 0.0


def plan_layers(source: Source, opts: ConvertOptions, target: Target, windows: torch.Tensor | None) -> Plan:
    """The per-layer choices; a first pass over the layers when the allocation or the export needs one."""
    if opts.to == "latent_kv":
        started = time.perf_counter()
        uniform = LatentChoice(target.latent_key_rank, target.latent_value_rank)
        if opts.rank_allocation != "retrieval":
            return Plan([uniform] * source.shape.layers)
        plan = Plan(*latent_retrieval_plan(source, opts, uniform, windows))
        plan.seconds = round(time.perf_counter() - started, 3)
        return plan
    if opts.to != "mla":
        return Plan(None)
    n = source.shape.layers
    uniform = [LayerChoice(target.rope_dim, target.kv_lora_rank) for _ in range(n)]
    started = time.perf_counter()
    if opts.rank_allocation == "sensitivity":
        plan = _sensitivity(source, opts, windows)
    elif opts.rank_allocation == "retrieval":  # copy-head layers exact (retrieval.py)
        plan = Plan(*retrieval_plan(source, opts, target, windows))
    elif opts.rank_allocation == "energy":
        energies = [LatentPlan([], torch.empty(0), torch.empty(0), mla_plan(opts, w, source.shape, stats, c).energy)
                    for (_, _, w, stats), c in zip(layer_statistics(source, windows), uniform)]  # fmt: skip
        ranks = allocate_ranks(energies, target.kv_lora_rank * n)
        plan = Plan([LayerChoice(target.rope_dim, r) for r in ranks])
    elif opts.format == "deepseek_v3":  # one component per frequency 0, s, 2s, ...: what a stock RoPE key turns at
        ranked = [ranked_components(opts.method, w, source.shape, stats, opts.rope_context)
                  for _, _, w, stats in layer_statistics(source, windows)]  # fmt: skip
        frequencies, stride = stock_frequencies(ranked, source.shape.half, target.rope_dim // 2)
        plan = Plan([LayerChoice(target.rope_dim, target.kv_lora_rank, frequencies) for _ in range(n)], stride=stride)
    else:
        return Plan(uniform)
    plan.seconds = round(time.perf_counter() - started, 3)
    return plan


def layer_statistics(source: Source, windows: torch.Tensor, measure=None) -> Iterator[tuple]:
    """(i, decoder layer i, its AttentionWeights on the CPU, its LayerStats) for every layer, in order: the source
    track carried (one layer resident), as layers.run_layers computes them."""
    src, shape = source.layers, source.shape
    tracks = Tracks(["source"], (*windows.shape, shape.hidden), src.dtype, src.device)
    runner = LayerRunner(src, windows.shape[1], BATCH)
    try:
        runner.embed(windows, tracks["source"].current)
        for i in range(src.num_layers):
            layer = src.layer(i)
            attn = src.attention(layer)[1]
            w = shape.arch.split_heads(attn).cpu()
            stats = track_statistics(runner, layer, attn, w, shape, i, tracks["source"])
            tracks["source"].swap()
            yield i, layer, w, stats
            del layer
    finally:
        tracks.close()


def _sensitivity(source: Source, opts: ConvertOptions, windows: torch.Tensor) -> Plan:
    """Plan by measured KL within the budget (budgets.py)."""
    from .sensitivity import Measurement

    started = time.process_time()
    total = budget_values(source.shape, opts.kv_budget)
    grid = candidate_grid(source.shape, opts.kv_budget, opts.rope_dim)
    count = max(1, MEASURE_TOKENS // windows.shape[1])
    measurement = Measurement(source.layers, windows[:count])
    options, kl = [], []
    for i, layer, w, stats in layer_statistics(source, windows):
        candidates = LayerCandidates(i, w, source.config, source.shape, stats, opts.method, opts.rope_context, grid)
        options.append(candidates.options)
        kl.append(measurement.layer(i, layer, candidates))
    chosen = choose([[(c.values, kl[l][k]) for k, c in enumerate(row)] for l, row in enumerate(options)], total)
    picks = [options[l][k] for l, k in enumerate(chosen)]
    report = allocation_report(options, kl, chosen, total, min(count, len(windows)), time.process_time() - started)
    logger.info("sensitivity allocation: %d of %d KV values per token, summed KL %.4g", report["values_per_token"],
                total, report["summed_kl"])  # fmt: skip
    return Plan([LayerChoice(c.rope_dim, c.rank, exact=c.exact) for c in picks], budgets=report)
