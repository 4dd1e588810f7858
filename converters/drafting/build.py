"""`hf-attn draft MODEL OUT`: build a feature drafter for MODEL from MODEL alone, and save it with its tokenizer.

Steps (each timed in the report): teacher samples of the target with its hidden states (samples.py), the draft
vocabulary (the most frequent sampled tokens), training (train.py), a held-in check (top-1 agreement with the target
per draft depth on samples kept out of training), then OUT written through a staging folder and renamed.
"""

from __future__ import annotations

import json
import logging
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ...models.pretrained import check_source_folder, load_source
from ..io.calibration import read_calibration_text
from .samples import teacher_samples
from .train import agreement, draft_vocabulary, new_drafter, train_drafter

logger = logging.getLogger(__name__)

CHECK_SHARE = 0.05  # share of the teacher samples kept out of training for the held-in agreement check


def build_drafter(
    source: str,
    out: str | Path,
    *,
    samples: int = 256,
    length: int = 224,
    draft_vocab: int = 8192,
    steps: int = 200,
    rows: int = 6,
    lr: float = 1e-3,
    depth: int = 2,
    calib_data=None,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Build a drafter for `source` into `out` (see the module docstring); returns the report (also in
    OUT/drafter_report.json)."""
    for name, value, low in (
        ("samples", samples, 8),
        ("length", length, 16),
        ("draft_vocab", draft_vocab, 16),
        ("steps", steps, 1),
        ("rows", rows, 1),
        ("depth", depth, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}: must be an integer >= {low}")
    if not lr > 0:
        raise ValueError(f"lr={lr!r}: must be > 0")
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    check_source_folder(source)
    started = time.perf_counter()
    target, tokenizer = load_source(source)
    target.requires_grad_(False)
    text = read_calibration_text(calib_data)
    tokens, hidden = teacher_samples(target, tokenizer, text, samples, length, seed=seed, progress=progress)
    sampled = time.perf_counter()
    held = max(1, int(len(tokens) * CHECK_SHARE))
    eos = getattr(target.config, "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    vocab = target.config.get_text_config(decoder=True).vocab_size
    ids = draft_vocabulary(tokens[held:], draft_vocab, vocab, always=eos)
    drafter = new_drafter(target, ids)
    losses = train_drafter(
        drafter, tokens[held:], hidden[held:], steps, rows=rows, lr=lr, depth=depth, seed=seed, progress=progress
    )
    trained = time.perf_counter()
    check = agreement(drafter, tokens[:held], hidden[:held], depth)
    report = {
        "source": source, "samples": len(tokens), "sample_length": length, "sample_tokens": int(tokens.numel()),
        "draft_vocab": len(ids), "draft_vocab_coverage": _coverage(tokens[:held], ids),
        "steps": steps, "rows": rows, "depth": depth, "lr": lr, "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]), "held_in_top1_agreement_by_depth": check,
        "sampling_s": round(sampled - started, 1), "training_s": round(trained - sampled, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "parameters": sum(p.numel() for p in drafter.parameters()),
    }  # fmt: skip
    _write(drafter, tokenizer, out, report, overwrite)
    report["build_s"] = round(time.perf_counter() - started, 1)
    report["size_mb"] = round(sum(f.stat().st_size for f in out.iterdir()) / 2**20, 1)
    (out / "drafter_report.json").write_text(json.dumps(report, indent=2))
    return report


def _coverage(tokens: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of the held-in sample tokens inside the draft vocabulary."""
    return round(float(torch.isin(tokens, ids).double().mean()), 4)


def _write(drafter, tokenizer, out: Path, report: dict, overwrite: bool) -> None:
    """Save into a staging sibling of OUT, then rename it: OUT is never half written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        drafter.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "drafter_report.json").write_text(json.dumps(report, indent=2))
        if out.exists() and overwrite:
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
