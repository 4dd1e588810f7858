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
from ..io.calibration import TEACHER_PROMPT, calibration_windows, sample_from_teacher
from ..io.heal_data import held_in_windows, retrieval_windows
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


def heal_whole(
    source: Source,
    native_folder: Path,
    opts: ConvertOptions,
    windows: torch.Tensor | None,
    stride: int | None,
    export_rope: int,
) -> Healed:
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
            windows = calibration_windows(
                calibration_text(opts.calibration), source.tokenizer, opts.calibration.samples, opts.calibration.length
            )
        layerwise = heal_layerwise(teacher, student, windows, heal.layerwise_steps)
    report = distill(
        student, teacher, source.tokenizer, opts, windows if opts.calibration.source == "teacher" else None
    )
    export = None
    if opts.format == "deepseek_v3":
        final_dtype = dtype_of(opts.dtype) if opts.dtype is not None else next(teacher.parameters()).dtype
        student, export = to_deepseek_v3(
            student,
            windows,
            stride,
            teacher.config,
            opts.engine,
            export_rope,
            "fit" if final_dtype == torch.float16 else "linear",
        )
    return Healed(student, report, layerwise, export)


def heal_layerwise(teacher, student, windows: torch.Tensor, steps: int) -> dict:
    """Healing's first stage (reconstruct target "block"): every attention layer of `student` fitted, layer by layer,
    so that its decoder layer's output matches the teacher's on the calibration windows; a summary for the report."""
    fits = sequential(teacher, student, windows, steps=steps, lr=LAYERWISE_LR, target="block")
    return {"steps": steps, "lr": LAYERWISE_LR, **summary(fits)}


def distill(student, teacher, tokenizer, opts: ConvertOptions, samples: torch.Tensor | None = None) -> dict:
    """Distill the source into the converted model (heal.py); a summary for the report.

    Data (heal_data), windows of heal_len tokens: calib: windows of the calibration text; teacher: the source's own
    continuations of TEACHER_PROMPT-token prompts cut from it (one window per training step and batch row, at most
    64, reused cyclically; `samples`, the teacher calibration windows when calib_source is "teacher" and heal_len is
    calib_len, are used instead of sampling again); mix: the two alternating; retrieval: io/heal_data.py's windows
    (repeated segments, recalled facts, plain text) with the KL weighted on the positions that retrieve, one fresh
    window per step and batch row. The last heal_held_in windows (of the same kind; retrieval: drawn from the last
    HELD_SHARE of the calibration tokens, which training never reads) are never trained on: they pick the learning
    rate (lr "auto") and the state returned."""
    heal, length = opts.healing, opts.healing.length
    text = calibration_text(opts.calibration)
    if heal.data == "retrieval":
        train, held_in = _retrieval_data(text, tokenizer, opts)
        # eval_every: held-in windows of ~1,024 tokens cost a teacher and a student pass each: 5 checks, not 10
        weighted = {"weights": train.weights, "held_in_weights": held_in.weights, "eval_every": max(1, heal.steps // 5)}
        return _run(student, teacher, heal, train.ids, held_in.ids, **weighted)
    tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
    if tokens < 2 * length:
        raise ValueError(f"heal_len={length}: the calibration text has {tokens} tokens, fewer than two windows")
    calib = calibration_windows(text, tokenizer, tokens // length, length)
    held = min(heal.held_in, len(calib) // 2)
    if samples is not None and samples.shape[1] != length:  # calibration samples of another length: sample anew
        samples = None
    if heal.data == "calib":
        windows = calib
    elif samples is not None:  # teacher calibration windows: no second sampling
        plain = calib[: len(samples)]
        windows = samples if heal.data == "teacher" else torch.stack((samples, plain), dim=1).flatten(0, 1)
        held = min(heal.held_in, len(windows) // 2)
    else:  # enough for every process's batches (data parallel: each takes its own windows of a step)
        count = min(64, heal.steps * heal.batch_size * _processes()) + held
        step = opts.calibration.length  # prompts cut every calib_len tokens (long windows would give fewer)
        starts = calib if step == length else calibration_windows(text, tokenizer, tokens // step, step)
        prompts = starts[torch.randperm(len(starts), generator=torch.Generator().manual_seed(opts.seed))[:count]]
        sampled = sample_from_teacher(teacher, prompts[:, :TEACHER_PROMPT], length, seed=opts.seed)
        if heal.data == "teacher":
            windows = sampled
        else:  # alternate teacher and calibration windows; held in: the same mix
            plain = calib[: len(sampled)]
            windows = torch.stack((sampled, plain), dim=1).flatten(0, 1)
    return _run(student, teacher, heal, windows[:-held], windows[-held:])


def _run(student, teacher, heal, train: torch.Tensor, held_in: torch.Tensor, **weighted) -> dict:
    """heal.py on train / held-in windows with the healing options; the report's "heal" section."""
    from ..fitting.heal import heal as run_heal

    result = run_heal(
        student,
        teacher,
        train,
        steps=heal.steps,
        lr=heal.lr,
        held_in=held_in,
        batch_size=heal.batch_size,
        train=heal.train,
        checkpoint_dir=heal.checkpoint_dir,
        checkpoint_every=heal.checkpoint_every,
        resume=heal.resume,
        **weighted,
    )
    return {
        "steps": result.steps,
        "tokens": result.tokens,
        "seconds": round(result.seconds, 2),
        "first_loss": result.losses[0],
        "last_loss": result.losses[-1],
        "train": heal.train,
        "lr": result.lr,
        "lr_option": heal.lr,
        "range_test": result.range_test,
        "data": heal.data,
        "length": heal.length,
        "windows": len(train),
        "held_in_windows": len(held_in),
        "held_in_kl": result.held_in,
        "best_step": result.best_step,
        "improved": result.improved,
        "losses": result.losses,
    }


def _processes() -> int:
    """The data-parallel processes healing runs in (each takes its own windows of a step)."""
    return int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun / accelerate launch


HELD_SHARE = 0.15  # retrieval data: the share of the calibration tokens kept for the held-in windows


def _retrieval_data(text: str, tokenizer, opts: ConvertOptions):
    """(train, held-in) WeightedWindows of heal_len tokens: one training window per step, batch row and process, from
    the first 1 - HELD_SHARE of the calibration tokens; heal_held_in windows from the rest, of the far shapes that
    select the state (held_in_windows: far repeats, far facts, plain text, each window weighing the same)."""
    heal, length = opts.healing, opts.healing.length
    stream = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    cut = len(stream) - max(int(len(stream) * HELD_SHARE), length + 1)
    if cut < length + 1:
        raise ValueError(
            f"heal_len={length}: the calibration text has {len(stream)} tokens; retrieval healing needs "
            f"at least {2 * (length + 1)} (one window to train on, one held in)"
        )
    train = retrieval_windows(stream[:cut], tokenizer, heal.steps * heal.batch_size * _processes(), length, opts.seed)
    return train, held_in_windows(stream[cut:], tokenizer, heal.held_in, length, opts.seed + 1)
