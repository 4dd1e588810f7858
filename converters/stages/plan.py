"""First pass, for the decisions that need every layer before any is converted (the target's plan hook decides,
with the passes below as its tools):
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
from ..options import ConvertOptions
from ..targets import target_of
from ..targets.base import LatentChoice, LayerChoice, Plan, Target
from .retrieval import latent_retrieval_plan, retrieval_plan
from .source import Source

logger = logging.getLogger(__name__)


def plan_layers(source: Source, opts: ConvertOptions, target: Target, windows: torch.Tensor | None) -> Plan:
    """The per-layer choices (the target's plan); a first pass over the layers when the allocation or the export
    needs one."""
    return target_of(opts.to).plan(PlanTools(source, opts, target, windows))


@dataclass
class PlanTools:
    """What a target's plan hook may run: the passes over the source's layers (statistics, the sensitivity
    measurement, the copy-head scores of the retrieval allocations)."""

    source: Source
    opts: ConvertOptions
    target: Target
    windows: torch.Tensor | None

    def layer_statistics(self) -> Iterator[tuple]:
        return layer_statistics(self.source, self.windows)

    def sensitivity(self) -> Plan:
        return _sensitivity(self.source, self.opts, self.windows)

    def retrieval(self) -> tuple:
        return retrieval_plan(self.source, self.opts, self.target, self.windows)

    def latent_retrieval(self, uniform: LatentChoice) -> tuple:
        return latent_retrieval_plan(self.source, self.opts, uniform, self.windows)


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
    logger.info(
        "sensitivity allocation: %d of %d KV values per token, summed KL %.4g",
        report["values_per_token"],
        total,
        report["summed_kl"],
    )
    return Plan([LayerChoice(c.rope_dim, c.rank, exact=c.exact) for c in picks], budgets=report)
