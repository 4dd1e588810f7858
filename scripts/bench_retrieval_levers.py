"""What loses retrieval in an MLA conversion: levers of the closed form, each measured on held-in teacher samples and
on the retrieval probes, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_retrieval_levers.py [--source smollm2] [--kv-budget 0.5]
        [--items 4] [--largest 1024] [--levers baseline,rope_context,calib_1024] [--out scripts/bench_retrieval_levers.json]

Levers (the closed form only: text calibration, uniform ranks, no reconstruction, so that each costs minutes):
    baseline      calib_len 256 (32 windows): the calibration windows, and L = 256 in the RoPE split's score
                  energy x 2(1 - sinc(theta L))
    rope_context  the same windows, L = the source's context (max_position_embeddings) in that score
    calib_1024    8 windows of 1024 tokens (the same 8,192 tokens), L = 1024 follows calib_len
Held-in measure (chosen on, never the probes): mean KL(source || converted) per token on 4 samples of the source
itself, 512 tokens long, prompted by calibration-corpus windows after those calibrated on; split into positions
< 256 and >= 256 (what a 256-token calibration never sees). Evaluation: retrieval accuracy per distance (passkey,
copy, induction; the source's vocabulary, seed 0).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters import methods
from hf_attn_patch.converters.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.models.pretrained import load_source
from hf_attn_patch.evaluation.retrieval import evaluate_retrieval, known_vocabulary, retained

LEVERS = {"baseline": {}, "rope_context": {"rope_context": True}, "calib_1024": {"calib_len": 1024, "calib_samples": 8}}


@torch.no_grad()
def position_kl(model, source, windows: torch.Tensor, split: int = 256) -> dict[str, float]:
    """Mean KL(source || model) per token at positions < split and >= split."""
    kls = []
    for w in windows:
        p = source(w[None]).logits[0].log_softmax(-1)
        q = model(w[None]).logits[0].log_softmax(-1)
        kls.append((p.exp() * (p - q)).sum(-1))
    kl = torch.stack(kls)  # [n, T]
    return {f"<{split}": float(kl[:, :split].mean()), f">={split}": float(kl[:, split:].mean()), "all": float(kl.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--kv-budget", type=float, default=0.5)
    parser.add_argument("--items", type=int, default=4)
    parser.add_argument("--smallest", type=int, default=16, help="shortest retrieval distance (default 16)")
    parser.add_argument("--tasks", default="passkey,copy,induction", help="retrieval tasks (comma-separated)")
    parser.add_argument("--largest", type=int, default=1024)
    parser.add_argument("--levers", default=",".join(LEVERS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).with_name("bench_retrieval_levers.json")))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source, tokenizer = load_source(args.source)
    text = read_calibration_text(None)
    cache = Path(args.out).with_suffix(".held_in.pt")  # the samples take long on a CPU: reused when present
    if cache.exists():
        held = torch.load(cache)
    else:
        held = teacher_windows(source, calibration_windows(text, tokenizer, 20, 512)[16:], seed=1, progress=False)
        torch.save(held, cache)
    vocab = known_vocabulary(source, tokenizer)
    probe = dict(items=args.items, largest=args.largest, smallest=args.smallest, vocab=vocab,
                 tasks=tuple(args.tasks.split(",")))  # fmt: skip
    base = evaluate_retrieval(source, tokenizer, **probe)
    rows = [{"lever": "source", "retrieval": base.to_dict()}]
    print("source", base.to_dict(), flush=True)
    original = methods.rotated_components
    for lever in args.levers.split(","):
        options = dict(LEVERS[lever])
        if options.pop("rope_context", False):
            context = source.config.max_position_embeddings
            methods.rotated_components = lambda w, config, stats, _context: original(w, config, stats, context)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                convert(args.source, Path(tmp) / "o", to="mla", kv_budget=args.kv_budget, rank_allocation="uniform",
                        **options)  # fmt: skip
                model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "o").eval()
        finally:
            methods.rotated_components = original
        kl = position_kl(model, source, held)
        result = evaluate_retrieval(model, tokenizer, **probe)
        keep = retained(result, base)
        rows.append({"lever": lever, "options": LEVERS[lever], "held_in_kl": kl, "retrieval": result.to_dict(),
                     "retained": {t: {str(d): v for d, v in r.items()} for t, r in keep.items()}})  # fmt: skip
        print(lever, "held-in KL", {k: round(v, 4) for k, v in kl.items()}, result.to_dict(), flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
