"""Long-window healing of a converted model: distillation from the source on windows of --length tokens, attention
weights only, with the wall time; the healed model is saved for scripts/bench_long_context.py.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_long_heal.py --student /tmp/convs/mla50 --out /tmp/convs/heal \
        [--length 1024] [--steps 12] [--lr 1e-4] [--data text|teacher]

The same loop as `hf-attn convert ... --heal-steps N --heal-len L --heal-batch-size 1 --heal-layerwise-steps 0`
(converters/heal.py), run on an already converted folder so the conversion is not repeated. Data (calibration only):
    text     windows 0..steps-1 of the package's TinyStories sample cut at --length (its first steps x length tokens);
             held in: the next window (the best held-in state is returned). The long-context benchmark's TinyStories
             passages come from the sample's last 60,000 characters, far after these.
    teacher  the source's own continuations (seed 0) of 4-token prompts from those windows (costs steps x length
             decoding steps of sampling first).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.converters.fitting.heal import heal
from hf_attn_patch.models.pretrained import load_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--student", required=True, help="a converted model folder (native format)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--data", choices=("text", "teacher"), default="text")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not (Path(args.student) / "config.json").exists():
        parser.error(f"--student {args.student!r} is not a saved model folder")
    torch.set_num_threads(args.threads)
    source, tokenizer = load_source(args.source)
    student = AutoModelForCausalLM.from_pretrained(args.student).eval()
    windows = calibration_windows(read_calibration_text(None), tokenizer, args.steps + 1, args.length)
    started = time.perf_counter()
    if args.data == "teacher":
        windows = teacher_windows(source, windows, seed=0)
    sampled = time.perf_counter() - started
    result = heal(student, source, windows[:-1], steps=args.steps, lr=args.lr, batch_size=1, held_in=windows[-1:],
                  eval_every=max(1, args.steps // 4))  # fmt: skip
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    student.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {"student": args.student, "length": args.length, "steps": args.steps, "lr": args.lr, "data": args.data,
               "sampling_s": round(sampled, 1), "heal_s": round(result.seconds, 1), "tokens": result.tokens,
               "held_in_kl": result.held_in, "best_step": result.best_step, "losses": result.losses}  # fmt: skip
    (out / "long_heal.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}), flush=True)


if __name__ == "__main__":
    main()
