"""The conversion report (conversion_report.json), built from the stages' typed results, and the clock that
measures each stage: wall seconds and peak resident memory (Linux: the VmHWM high-water mark, reset before each
stage through /proc/self/clear_refs; elsewhere the process's ru_maxrss so far), plus the accelerator's peak
allocation when the conversion runs on CUDA."""

from __future__ import annotations

import logging
import resource
import time
from pathlib import Path

import torch

from ...hub import engines
from ...kv_memory import kv_cache_bytes
from ..options import ConvertOptions
from ..targets import target_of
from ..fitting.reconstruct import summary

logger = logging.getLogger(__name__)
STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def rss_peak_mb() -> float:
    """The process's peak resident memory in MB since the last reset (VmHWM), else since it started."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _reset_rss_peak() -> None:
    try:
        CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


class Clock:
    """run(name, fn, *args): fn's result; `stages`: {name: {"seconds", "peak_rss_mb"[, "peak_device_mb"]}}."""

    def __init__(self, device: torch.device):
        self.device, self.stages, self.started = device, {}, time.perf_counter()

    def run(self, name: str, fn, *args, **kwargs):
        _reset_rss_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t = time.perf_counter()
        result = fn(*args, **kwargs)
        entry = {"seconds": round(time.perf_counter() - t, 3), "peak_rss_mb": rss_peak_mb()}
        if self.device.type == "cuda":
            entry["peak_device_mb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        self.stages[name] = entry
        logger.info("stage %s: %.2f s, peak RSS %.1f MB", name, entry["seconds"], entry["peak_rss_mb"])
        return result

    def peak_rss_mb(self) -> float:
        """The largest of the stages' peaks."""
        return max((s["peak_rss_mb"] for s in self.stages.values()), default=rss_peak_mb())


def build_report(source, opts: ConvertOptions, target, cal, plan, layers, healed, config, clock: Clock) -> dict:
    """conversion_report.json's keys (the in-memory converter's, plus "stages", "activations" and
    "teacher_sampling")."""
    src_config = source.config
    report = {
        "source": source.name,
        "options": opts.flat(),
        "given_options": dict(opts.given),
        "model_type": src_config.model_type,
    }
    if cal.windows is not None:
        report["calibration"] = cal.section
    report.update(target_of(opts.to).report(opts, target, plan, layers))  # the target's section
    if plan.budgets is not None:
        report["budgets"] = plan.budgets
    if target.layerwise:
        propagate = opts.calibration.propagate and opts.method != "mean"
        rec = opts.reconstruction
        report["layerwise"] = {
            "propagate": propagate,
            "reconstruct_steps": rec.steps,
            "target": rec.target,
            "attention_kl": rec.attention_kl,
            **summary(layers.fits),
        }
    if healed is not None:
        if healed.layerwise is not None:
            report["heal_layerwise"] = healed.layerwise
        report["heal"] = healed.heal
    if opts.format == "deepseek_v3":
        report["deepseek_v3"] = healed.export if healed is not None else layers.export
    report["format"] = opts.format if opts.format == "deepseek_v3" else target.format
    report["engines"] = engines(report)  # where the export was run (tested) and where only in theory
    report["card"] = target_of(opts.to).card(report)  # what the model card says of the target's output
    report["kv_bytes_per_token_fp16"] = {"before": kv_cache_bytes(src_config, 1), "after": kv_cache_bytes(config, 1)}
    report["kv_ratio"] = report["kv_bytes_per_token_fp16"]["after"] / report["kv_bytes_per_token_fp16"]["before"]
    report["wall_time_s"] = round(time.perf_counter() - clock.started, 3)
    report["peak_rss_mb"] = clock.peak_rss_mb()
    report["stages"] = {**clock.stages, "layer_loop_seconds": layers.seconds, "plan_seconds": plan.seconds}
    report["activations"] = layers.activations or {"placement": None, "bytes": 0}
    report["teacher_sampling"] = cal.teacher_sampling
    return report
