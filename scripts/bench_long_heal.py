"""Long-window healing of a converted model: distillation from the source on windows of --length tokens, with the
held-in KL before and after and the wall time; the healed model is saved for scripts/bench_long_context.py.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_long_heal.py --student /tmp/convs/mla50 --out /tmp/convs/heal \
        [--data text|teacher|retrieval] [--length 1024] [--steps 12] [--lr 1e-4|auto] [--threads 1]
        [--batch-size 1] [--held-in 8] [--mix repeat=2,facts=1,plain=1] [--train attention] [--seed 0]

The same loop as `hf-attn convert ... --heal-steps N --heal-len L --heal-data D --heal-layerwise-steps 0`
(converters/fitting/heal.py), run on an already converted folder so the conversion is not repeated. Data
(calibration only; the probes' texts, ../shared/evals and WikiText never enter):
    text       windows 0..steps-1 of the package's TinyStories sample cut at --length (its first steps x length
               tokens); held in: the next window (the best held-in state is returned). The long-context benchmark's
               TinyStories passages come from the sample's last 60,000 characters, far after these.
    teacher    the source's own continuations (seed 0) of 4-token prompts from those windows (costs steps x length
               decoding steps of sampling first).
    retrieval  windows that ask for retrieval from far back (converters/io/heal_data.py: repeated segments, facts
               asked again at the end, plain text; --mix), KL weighted on the positions that retrieve: from the
               corpus without the passage probe's last 60,000 characters, the first 85% of its tokens for training,
               --held-in windows of the same kinds (another seed) from the rest.
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
from bench_long_context import PROBE_CHARS
from hf_attn_patch.converters.fitting.heal import heal
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.converters.io.heal_data import retrieval_windows
from hf_attn_patch.converters.stages.heal import HELD_SHARE
from hf_attn_patch.models.pretrained import load_source


def natural_data(args, source, tokenizer) -> dict:
    """text / teacher: steps training windows and the next one held in."""
    windows = calibration_windows(read_calibration_text(None), tokenizer, args.steps + 1, args.length)
    if args.data == "teacher":
        windows = teacher_windows(source, windows, seed=0)
    return dict(windows=windows[:-1], held_in=windows[-1:])


def retrieval_data(args, tokenizer, mix: dict) -> dict:
    """retrieval: weighted windows from the corpus before the probe's text, held in from its last HELD_SHARE."""
    text = read_calibration_text(None)[:-PROBE_CHARS]
    stream = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    cut = int(len(stream) * (1 - HELD_SHARE))
    count = args.steps * args.batch_size
    train = retrieval_windows(stream[:cut], tokenizer, count, args.length, seed=args.seed, mix=mix)
    held = retrieval_windows(stream[cut:], tokenizer, args.held_in, args.length, seed=args.seed + 1, mix=mix)
    return dict(windows=train.ids, weights=train.weights, held_in=held.ids, held_in_weights=held.weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--student", required=True, help="a converted model folder (native format)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", choices=("text", "teacher", "retrieval"), default="text")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", default="1e-4", help="a rate, or auto (the range test)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--held-in", type=int, default=8, help="retrieval: held-in windows")
    parser.add_argument("--mix", default="repeat=2,facts=1,plain=1", help="retrieval: the kinds' shares")
    parser.add_argument("--train", default="attention")
    parser.add_argument("--seed", type=int, default=0, help="retrieval: the windows' seed")
    args = parser.parse_args()
    if not (Path(args.student) / "config.json").exists():
        parser.error(f"--student {args.student!r} is not a saved model folder")
    try:
        lr = args.lr if args.lr == "auto" else float(args.lr)
        mix = {kind: float(share) for kind, share in (part.split("=") for part in args.mix.split(","))}
    except ValueError:
        parser.error(f"--lr {args.lr!r} or --mix {args.mix!r} does not parse")
    torch.set_num_threads(args.threads)
    source, tokenizer = load_source(args.source)
    student = AutoModelForCausalLM.from_pretrained(args.student).eval()
    started = time.perf_counter()
    data = retrieval_data(args, tokenizer, mix) if args.data == "retrieval" else natural_data(args, source, tokenizer)
    prepared = time.perf_counter() - started
    result = heal(student, source, data.pop("windows"), **data, steps=args.steps, lr=lr, batch_size=args.batch_size,
                  train=args.train, eval_every=max(1, args.steps // 6))  # fmt: skip
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    student.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {"student": args.student, "data": args.data, "length": args.length, "steps": args.steps,
               "lr": result.lr, "batch_size": args.batch_size, "train": args.train,
               **({"mix": mix} if args.data == "retrieval" else {}), "data_s": round(prepared, 1),
               "heal_s": round(result.seconds, 1), "s_per_step": round(result.seconds / max(1, result.steps), 2),
               "tokens": result.tokens, "held_in_kl": result.held_in, "best_step": result.best_step,
               "improved": result.improved, "range_test": result.range_test, "losses": result.losses}  # fmt: skip
    (out / "long_heal.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}), flush=True)


if __name__ == "__main__":
    main()
