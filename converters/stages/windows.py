"""Calibration windows: [n, T] token windows of the calibration text, or the source's own samples prompted by them.

Sampling from the source (calib_source "teacher") is generation: every new token runs the whole model. When the
source's weights fit the memory budget (half of the device's free memory, or of the CPU's available memory) the
whole model is loaded for it, and freed after; otherwise accelerate's big-model inference runs it with the layers
that do not fit offloaded to the CPU and then to disk (device_map "auto", max_memory = the budget, an offload
folder), which reads the offloaded weights once per generated token. The report says which ran and how long it took.
"""

from __future__ import annotations

import functools
import gc
import logging
import tempfile
import time
from dataclasses import dataclass

import torch

from ..io.calibration import calibration_windows, read_calibration_text, teacher_windows
from ..io.layer_stream import available_cpu_bytes
from ..io.packing import packed_positions, packed_teacher_windows, parse_lengths
from ..options import ConvertOptions
from .source import Source

logger = logging.getLogger(__name__)


@dataclass
class Calibration:
    """windows [n, T] (None: no stage needs them); section: the report's "calibration";
    teacher_sampling: {"mode": "whole" | "offload", "seconds", "budget_bytes"} when the source sampled them."""

    windows: torch.Tensor | None
    section: dict
    teacher_sampling: dict | None = None


def calibrate(source: Source, opts: ConvertOptions, needed: bool, budget: int | None = None) -> Calibration:
    """The calibration windows (when `needed`); budget: bytes the whole model may take for sampling (default: half
    the device's free memory, or half the CPU's available memory)."""
    cal = opts.calibration
    section = {
        "data": cal.data or "package corpus (TinyStories sample)",
        "source": cal.source,
        "split": cal.split,
        "column": cal.column,
        "samples": cal.samples,
        "length": cal.length,
        "lengths": cal.lengths,
    }
    if not needed:
        return Calibration(None, section)
    windows = calibration_windows(calibration_text(cal), source.tokenizer, cal.samples, cal.length)
    lengths = parse_lengths(cal.lengths, cal.length) if cal.lengths else None
    source.layers.positions = packed_positions(lengths) if lengths else None  # mixed lengths: packed windows
    if cal.source != "teacher":
        return Calibration(windows, section)
    started = time.perf_counter()
    budget = memory_budget(source.device) if budget is None else budget
    mode = "whole" if source.layers.size_bytes() <= budget else "offload"
    teacher, offload_dir = (source.whole(), None) if mode == "whole" else _offloaded(source, budget)
    try:
        windows = (
            packed_teacher_windows(teacher_windows, teacher, windows, lengths, opts.seed)
            if lengths
            else teacher_windows(teacher, windows, seed=opts.seed)
        )
    finally:
        del teacher
        gc.collect()
        if offload_dir is not None:
            offload_dir.cleanup()
    sampling = {"mode": mode, "seconds": round(time.perf_counter() - started, 3), "budget_bytes": budget}
    logger.info("teacher samples: %s model, %.1f s", mode, sampling["seconds"])
    return Calibration(windows, section, sampling)


@functools.cache
def _text(data, split, column) -> str:
    return read_calibration_text(data, split, column)


def calibration_text(cal) -> str:
    """The calibration text of CalibrationOptions `cal` (read once per process and source)."""
    return _text(cal.data, cal.split, cal.column)


def memory_budget(device: torch.device) -> int:
    """Bytes a whole-model step may take: half the accelerator's free memory, or half the CPU's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    return available_cpu_bytes() // 2


def _offloaded(source: Source, budget: int):
    """(the source dispatched by accelerate within `budget` bytes, its offload folder)."""
    from transformers import AutoModelForCausalLM

    folder = tempfile.TemporaryDirectory(prefix="hf-attn-offload-")
    where = (source.device.index or 0) if source.device.type == "cuda" else "cpu"
    max_memory = {where: budget} if where != "cpu" else {"cpu": budget}
    if where != "cpu":
        max_memory["cpu"] = memory_budget(torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(
        source.layers.folder,
        dtype=source.layers.dtype,
        device_map="auto",
        max_memory=max_memory,
        offload_folder=folder.name,
    )
    logger.info("teacher sampling offloaded by accelerate: %s", sorted(set(model.hf_device_map.values()), key=str))
    return model.eval(), folder
