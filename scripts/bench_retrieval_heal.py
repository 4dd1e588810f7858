"""Retrieval-aware healing of a converted model (converters/io/heal_data.py): KL to the source on windows that ask
for retrieval from far back, with the held-in weighted KL before and after and the wall time; the healed model is
saved for scripts/bench_long_context.py (the probes).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_retrieval_heal.py --student /tmp/convs/lkv50 \
        --out /tmp/convs/lkv50_heal [--length 1024] [--steps 60] [--lr 2e-5] [--mix repeat=2,facts=1,plain=1]

Data: the package's calibration corpus without its last 60,000 characters (the passage probe's text): its first
85% of tokens for training, the rest for the held-in windows (the same kinds, another seed). The probes' texts,
../shared/evals and WikiText never enter.
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
from hf_attn_patch.converters.fitting.heal import heal
from hf_attn_patch.converters.io.calibration import read_calibration_text
from hf_attn_patch.converters.io.heal_data import retrieval_windows
from hf_attn_patch.models.pretrained import load_source

PROBE_CHARS = 60_000  # scripts/bench_long_context.py: the passage probe reads the corpus's last 60,000 characters
HELD_SHARE = 0.15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--student", required=True, help="a converted model folder (native format)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", default="2e-5")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--held-in", type=int, default=8)
    parser.add_argument("--mix", default="repeat=2,facts=1,plain=1")
    parser.add_argument("--train", default="attention")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    mix = {k: float(v) for k, v in (part.split("=") for part in args.mix.split(","))}
    lr = args.lr if args.lr == "auto" else float(args.lr)
    source, tokenizer = load_source(args.source)
    student = AutoModelForCausalLM.from_pretrained(args.student).eval()
    text = read_calibration_text(None)[:-PROBE_CHARS]
    stream = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    cut = int(len(stream) * (1 - HELD_SHARE))
    count = args.steps * args.batch_size
    train = retrieval_windows(stream[:cut], tokenizer, count, args.length, seed=args.seed, mix=mix)
    held = retrieval_windows(stream[cut:], tokenizer, args.held_in, args.length, seed=args.seed + 1, mix=mix)
    result = heal(student, source, train.ids, weights=train.weights, held_in=held.ids, held_in_weights=held.weights,
                  steps=args.steps, lr=lr, batch_size=args.batch_size, train=args.train,
                  eval_every=max(1, args.steps // 6))  # fmt: skip
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    student.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {"student": args.student, "length": args.length, "steps": args.steps, "lr": result.lr, "mix": mix,
               "batch_size": args.batch_size, "train": args.train, "heal_s": round(result.seconds, 1),
               "s_per_step": round(result.seconds / max(1, result.steps), 2), "held_in_kl": result.held_in,
               "best_step": result.best_step, "range_test": result.range_test, "losses": result.losses}  # fmt: skip
    (out / "retrieval_heal.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}), flush=True)


if __name__ == "__main__":
    main()
