"""Healing (heal_steps > 0): distillation of the source into the converted model, end to end, so on whole models.

The layer loop writes the native converted model into a temporary folder; the source (teacher) and the converted
model (student) are then loaded whole, healing's first stage fits every attention layer to its decoder layer's
output (reconstruct target "block"), the end-to-end distillation follows (heal.py), and a deepseek_v3 export runs
on the healed native model (deepseek_export.to_deepseek_v3: the export's scaled latent rows, ~1e-8, would not
survive optimizer steps sized for the other weights). Memory: both whole models, plus the optimizer's state of the
trained weights: the layer-streamed bound does not hold while healing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ...kv_memory import dtype_of
from ..io.calibration import calibration_windows, teacher_windows
from ..export.deepseek_export import to_deepseek_v3
from ..options import ConvertOptions
from ..fitting.reconstruct import LAYERWISE_LR, sequential, summary
from .source import Source
from .windows import calibration_text


@dataclass
class Healed:
    """model: the healed model (the deepseek_v3 export of it for that format); layerwise / heal / export: the
    report's "heal_layerwise", "heal" and "deepseek_v3" sections (None when not run)."""

    model: torch.nn.Module
    heal: dict
    layerwise: dict | None = None
    export: dict | None = None


def heal_whole(source: Source, native_folder: Path, opts: ConvertOptions, windows: torch.Tensor | None,
               stride: int | None, export_rope: int) -> Healed:  # fmt: skip
    """Heal the native model written in native_folder (see the module docstring); windows: the calibration windows
    (None when the conversion needed none)."""
    from transformers import AutoModelForCausalLM

    teacher = source.whole()
    student = AutoModelForCausalLM.from_pretrained(native_folder).to(source.device)
    student.generation_config = source.generation_config
    heal = opts.healing
    layerwise = None
    if heal.layerwise_steps:  # healing's first stage, layer by layer, on the native form
        if windows is None:
            windows = calibration_windows(calibration_text(opts.calibration), source.tokenizer,
                                          opts.calibration.samples, opts.calibration.length)  # fmt: skip
        layerwise = heal_layerwise(teacher, student, windows, heal.layerwise_steps)
    report = distill(student, teacher, source.tokenizer, opts,
                     windows if opts.calibration.source == "teacher" else None)  # fmt: skip
    export = None
    if opts.format == "deepseek_v3":
        final_dtype = dtype_of(opts.dtype) if opts.dtype is not None else next(teacher.parameters()).dtype
        student, export = to_deepseek_v3(student, windows, stride, teacher.config, opts.engine, export_rope,
                                         "fit" if final_dtype == torch.float16 else "linear")  # fmt: skip
    return Healed(student, report, layerwise, export)


def heal_layerwise(teacher, student, windows: torch.Tensor, steps: int) -> dict:
    """Healing's first stage (reconstruct target "block"): every attention layer of `student` fitted, layer by layer,
    so that its decoder layer's output matches the teacher's on the calibration windows; a summary for the report."""
    fits = sequential(teacher, student, windows, steps=steps, lr=LAYERWISE_LR, target="block")
    return {"steps": steps, "lr": LAYERWISE_LR, **summary(fits)}


def distill(student, teacher, tokenizer, opts: ConvertOptions, samples: torch.Tensor | None = None) -> dict:
    """Distill the source into the converted model (heal.py); a summary for the report.

    Data (heal_data): calib: windows of the calibration text; teacher: the source's own continuations of
    TEACHER_PROMPT-token prompts cut from it (one window per training step and batch row, at most 64, reused
    cyclically; `samples`, the teacher calibration windows when calib_source is "teacher", are used instead of
    sampling again); mix: the two alternating. The last heal_held_in windows (of the same kind) are never trained on:
    they pick the learning rate (lr "auto") and the state returned."""
    from ..fitting.heal import heal as run_heal

    heal, length = opts.healing, opts.calibration.length
    text = calibration_text(opts.calibration)
    tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
    calib = calibration_windows(text, tokenizer, tokens // length, length)
    held = min(heal.held_in, len(calib) // 2)
    if heal.data == "calib":
        windows = calib
    elif samples is not None:  # teacher calibration windows: no second sampling
        plain = calib[: len(samples)]
        windows = samples if heal.data == "teacher" else torch.stack((samples, plain), dim=1).flatten(0, 1)
        held = min(heal.held_in, len(windows) // 2)
    else:  # enough for every process's batches (data parallel: each takes its own windows of a step)
        processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
        count = min(64, heal.steps * heal.batch_size * processes) + held
        prompts = calib[torch.randperm(len(calib), generator=torch.Generator().manual_seed(opts.seed))[:count]]
        sampled = teacher_windows(teacher, prompts, seed=opts.seed)
        if heal.data == "teacher":
            windows = sampled
        else:  # alternate teacher and calibration windows; held in: the same mix
            plain = calib[: len(sampled)]
            windows = torch.stack((sampled, plain), dim=1).flatten(0, 1)
    train, held_in = windows[:-held], windows[-held:]
    result = run_heal(student, teacher, train, steps=heal.steps, lr=heal.lr, held_in=held_in,
                      batch_size=heal.batch_size, train=heal.train, checkpoint_dir=heal.checkpoint_dir,
                      checkpoint_every=heal.checkpoint_every, resume=heal.resume)  # fmt: skip
    return {"steps": result.steps, "tokens": result.tokens, "seconds": round(result.seconds, 2),
            "first_loss": result.losses[0], "last_loss": result.losses[-1], "train": heal.train,
            "lr": result.lr, "lr_option": heal.lr, "range_test": result.range_test, "data": heal.data,
            "windows": len(train), "held_in_windows": held, "held_in_kl": result.held_in,
            "best_step": result.best_step, "losses": result.losses}  # fmt: skip
