"""KV budgets by measured sensitivity vs uniform and energy rank allocation, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_budgets.py [--models default,smollm2] [--budgets 0.5,0.25]
        [--allocations uniform,energy,sensitivity] [--reconstruct-steps 0] [--calib-source text] [--json rows.json]

Per model, budget and allocation: `convert(..., to="mla", kv_budget=F, rank_allocation=A)` (method calibrated,
calibration on the package corpus, first 16 x 256 tokens; the sensitivity KL on its first 4 windows), then
perplexity on texts never calibrated on, KL(source || converted) per token on the first, KV bytes per token (fp16,
all layers, from the saved config) and the conversion's CPU seconds (time.process_time of this process).
Evaluation as scripts/bench_convert.py: stories260k on the last 60,000 characters of the TinyStories sample (8 x 256)
and tinyshakespeare (first 100,000 characters, 8 x 256); SmolLM2-135M on WikiText-2 test (first 200,000 characters,
4 x 512) and tinyshakespeare (4 x 512). The per-layer choices (RoPE dims + latent rank, or unconverted) are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoModelForCausalLM

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.models.pretrained import load_source
from hf_attn_patch.evaluation.perplexity import evaluate
from hf_attn_patch.kv_memory import kv_cache_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import eval_sets  # noqa: E402  (the same evaluation texts and windows)

LABELS = {"default": "stories260k", "smollm2": "SmolLM2-135M"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,smollm2")
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--allocations", default="uniform,energy,sensitivity")
    parser.add_argument("--reconstruct-steps", type=int, default=0)
    parser.add_argument("--calib-source", default="text", help="text (convert()'s default) or teacher (the CLI's)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        source, tokenizer = load_source(name)
        sets = eval_sets(name, tokenizer)
        first = next(iter(sets))
        base = {k: evaluate(source, w, progress=False).perplexity for k, w in sets.items()}
        print(f"{LABELS[name]}: source ppl {_fmt(base)}  KV {kv_cache_bytes(source.config, 1)} B/token", flush=True)
        rows.append(dict(model=LABELS[name], budget=1.0, allocation="source", ppl=base, kl=0.0, kv=kv_cache_bytes(
            source.config, 1), cpu=0.0, layers=None))  # fmt: skip
        for budget in map(float, args.budgets.split(",")):
            for allocation in args.allocations.split(","):
                row = _run(name, budget, allocation, args.reconstruct_steps, args.calib_source, sets, source, first)
                rows.append(dict(model=LABELS[name], budget=budget, allocation=allocation, **row))
                print(f"  MLA {budget:.0%} {allocation:<12} steps {args.reconstruct_steps:<4} {row['kv']:>6} B  "
                      f"ppl {_fmt(row['ppl'])}  KL {row['kl']:.4f}  {row['cpu']:.0f} s CPU", flush=True)
                if row["layers"]:
                    print(f"    layers (d_r+d_c): {row['layers']}", flush=True)
    names = sorted({k for r in rows for k in r["ppl"]}, key=lambda k: k not in ("stories", "wikitext2"))
    print(f"\ncalibration: {args.calib_source}")
    print("\n| model | KV budget | allocation | reconstruct steps | KV B/token | "
          + " | ".join(f"ppl {k}" for k in names) + " | KL | convert CPU s |")
    print("|---|---:|---|---:|---:|" + "---:|" * len(names) + "---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['budget']:.0%} | {r['allocation']} | {args.reconstruct_steps} | {r['kv']} | "
              + " | ".join(f"{r['ppl'][k]:.2f}" if k in r["ppl"] else "-" for k in names)
              + f" | {r['kl']:.4f} | {r['cpu']:.0f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _run(name, budget, allocation, steps, calib_source, sets, source, first) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cpu = time.process_time()
        report = convert(name, Path(tmp) / "out", to="mla", kv_budget=budget, rank_allocation=allocation,
                         reconstruct_steps=steps, calib_source=calib_source)  # fmt: skip
        cpu = time.process_time() - cpu
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out").eval()
        kv = kv_cache_bytes(model.config, 1)
        assert kv == report["kv_bytes_per_token_fp16"]["after"], (kv, report["kv_bytes_per_token_fp16"])
        ppl = {k: evaluate(model, w, progress=False).perplexity for k, w in sets.items()}
        kl = evaluate(model, sets[first], reference=source, progress=False).kl_to_reference
    layers = None
    if "budgets" in report:
        layers = " ".join("exact" if c["choice"] != "mla" else f"{c['rope_dim']}+{c['kv_lora_rank']}"
                          for c in report["budgets"]["layers"])  # fmt: skip
    elif allocation == "energy":
        layers = " ".join(f"{report['mla']['qk_rope_head_dim']}+{r}" for r in report["mla"]["kv_lora_rank_per_layer"])
    return dict(ppl=ppl, kl=kl, kv=kv, cpu=cpu, layers=layers)


def _fmt(ppl: dict) -> str:
    return " / ".join(f"{v:.2f}" for v in ppl.values())


if __name__ == "__main__":
    main()
