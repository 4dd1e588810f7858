"""Conversion quality: every method, closed form and reconstructed, one-shot and healed, in one run.

    .venv/bin/python scripts/bench_convert.py [--quick] [--reconstruct-steps 200] [--heal-steps N] [--out bench_convert.png]

For each model and target: perplexity on two evaluation texts that are never calibrated or healed on, mean KL(source
|| converted) per token on the first, KV bytes per token (fp16, all layers), conversion wall and CPU time
(time.process_time of this process: on a shared machine the wall time is noise, the CPU time less so).
Calibration (all methods, and the choice of every setting): the package corpus (TinyStories sample, first 16 x 256
tokens). Evaluation: stories260k on the last 60,000 characters of the TinyStories sample (8 x 256 tokens) and on
tinyshakespeare (first 100,000 characters, 8 x 256); SmolLM2-135M on WikiText-2 test (first 200,000 characters, 4 x
512) and tinyshakespeare (4 x 512). Rows per target: each closed-form method, then the default method with
layer-by-layer reconstruction (`reconstruct_steps`, the CLI default). Healing (--heal-steps, default 100 / 50):
from the reconstructed start, KL distillation on a mix of the source's own samples and calibration text, lr "auto"
(range test on held-in calibration windows), best held-in state kept: convert()'s own healing path.
Writes a PNG of perplexity vs KV bytes and the rows as JSON beside it. --quick: stories260k only.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.convert import convert, load_source
from hf_attn_patch.converters.evaluate import evaluate, windows_of
from hf_attn_patch.kv_memory import kv_cache_bytes

CORPORA = Path(__file__).resolve().parents[2] / "shared" / "corpora"
METHODS = {"gqa": ("mean", "aligned", "pca"), "mla": ("mha2mla", "calibrated")}
DEFAULT = {"gqa": "pca", "mla": "calibrated"}
TARGETS = {
    "default": [("GQA 4->2", dict(to="gqa", kv_heads=2)), ("MQA 4->1", dict(to="mqa")),
                ("MLA 50%", dict(to="mla", kv_budget=0.5)), ("MLA 25%", dict(to="mla", kv_budget=0.25))],
    "smollm2": [("MQA 3->1", dict(to="mqa")), ("MLA 50%", dict(to="mla", kv_budget=0.5)),
                ("MLA 25%", dict(to="mla", kv_budget=0.25)), ("MLA 12.5%", dict(to="mla", kv_budget=0.125))],
}  # fmt: skip
HEAL = {"default": (100, 4), "smollm2": (50, 2)}  # steps, windows per step


def eval_sets(name: str, tokenizer) -> dict[str, torch.Tensor]:
    shakespeare = (CORPORA / "tinyshakespeare.txt").read_text()[:100_000]
    if name == "default":
        stories = (CORPORA / "tinystories_sample.txt").read_text()[-60_000:]
        return {"stories": windows_of(stories, tokenizer, 256, 2048), "shakespeare": windows_of(shakespeare, tokenizer, 256, 2048)}
    wiki = (CORPORA / "wikitext2_test.txt").read_text()[:200_000]
    return {"wikitext2": windows_of(wiki, tokenizer, 512, 2048), "shakespeare": windows_of(shakespeare, tokenizer, 512, 2048)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reconstruct-steps", type=int, default=200)
    parser.add_argument("--heal-steps", type=int, help="default: 100 (stories260k) / 50 (SmolLM2); 0: no healing")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")), help="PNG of perplexity vs KV bytes")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the rows saved next to it")
    args = parser.parse_args()
    rows_file = Path(args.out).with_suffix(".json")
    if args.plot_only:
        _plot(json.loads(rows_file.read_text()), args.out)
        return
    torch.set_num_threads(2)
    rows = []
    for name in ["default"] if args.quick else ["default", "smollm2"]:
        source, tokenizer = load_source(name)
        sets = eval_sets(name, tokenizer)
        first = next(iter(sets))
        label = "stories260k" if name == "default" else "SmolLM2-135M"
        base = {k: evaluate(source, w, progress=False).perplexity for k, w in sets.items()}
        rows.append(dict(model=label, target="source", method="-", kv=kv_cache_bytes(source.config, 1), ppl=base,
                         kl=0.0, wall=0.0, cpu=0.0, healed=None))  # fmt: skip
        print(f"{label}: source {base}", flush=True)
        steps, batch = HEAL[name]
        steps = steps if args.heal_steps is None else args.heal_steps
        for target, options in TARGETS[name]:
            family = "mla" if options["to"] == "mla" else "gqa"
            runs = [(m, dict(method=m)) for m in METHODS[family]]
            runs.append((f"{DEFAULT[family]} + reconstruction", dict(method=DEFAULT[family],
                                                                     reconstruct_steps=args.reconstruct_steps)))
            for method, extra in runs:
                healing = steps and "reconstruction" in method
                row = _run(name, {**options, **extra}, sets, source, first, dict(heal_steps=steps, heal_batch_size=batch,
                           heal_data="mix") if healing else None)  # fmt: skip
                rows.append(dict(model=label, target=target, method=method, **row))
                print(f"  {target:<9} {method:<26} {row['kv']:>6} B  ppl {_fmt(row['ppl'])}  KL {row['kl']:.3f}  "
                      f"{row['wall']:.0f} s wall / {row['cpu']:.0f} s CPU" + (f"  healed {_fmt(row['healed'])} (lr "
                      f"{row['heal_lr']:g}, {row['heal_cpu']:.0f} s CPU)" if row["healed"] else ""), flush=True)  # fmt: skip
    names = sorted({k for r in rows for k in r["ppl"]}, key=lambda k: k != "stories" and k != "wikitext2")
    print("\n| model | target | method | KV B/token | " + " | ".join(f"ppl {k}" for k in names)
          + " | KL | convert wall / CPU s | healed ppl (lr, CPU s) |")
    print("|---|---|---|---:|" + "---:|" * len(names) + "---:|---:|---:|")
    for r in rows:
        healed = "-" if not r["healed"] else f"{_fmt(r['healed'])} ({r['heal_lr']:g}, {r['heal_cpu']:.0f})"
        print(f"| {r['model']} | {r['target']} | {r['method']} | {r['kv']} | "
              + " | ".join(f"{r['ppl'].get(k, float('nan')):.2f}" for k in names)
              + f" | {r['kl']:.3f} | {r['wall']:.0f} / {r['cpu']:.0f} | {healed} |")  # fmt: skip
    rows_file.write_text(json.dumps(rows, indent=1))
    _plot(rows, args.out)


def _fmt(ppl: dict) -> str:
    return " / ".join(f"{v:.2f}" for v in ppl.values())


def _run(name, options, sets, source, first, heal) -> dict:
    """Convert (one-shot), evaluate; with `heal`, convert again with healing from the same start and evaluate."""
    with tempfile.TemporaryDirectory() as tmp:
        wall, cpu = time.perf_counter(), time.process_time()
        report = convert(name, Path(tmp) / "out", **options)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out").eval()
        ppl = {k: evaluate(model, w, progress=False).perplexity for k, w in sets.items()}
        kl = evaluate(model, sets[first], reference=source, progress=False).kl_to_reference
        row = dict(kv=report["kv_bytes_per_token_fp16"]["after"], ppl=ppl, kl=kl, wall=wall, cpu=cpu, healed=None)
        if heal:
            heal_cpu = time.process_time()
            healed_report = convert(name, Path(tmp) / "healed", **options, **heal)
            healed = AutoModelForCausalLM.from_pretrained(Path(tmp) / "healed").eval()
            row.update(healed={k: evaluate(healed, w, progress=False).perplexity for k, w in sets.items()},
                       heal_lr=healed_report["heal"]["lr"], heal_cpu=time.process_time() - heal_cpu - cpu,
                       heal_best_step=healed_report["heal"]["best_step"])  # fmt: skip
    return row


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    colors = dict(zip(["mean", "aligned", "pca", "mha2mla", "calibrated", "pca + reconstruction",
                       "calibrated + reconstruction"], ["tab:orange", "tab:blue", "tab:purple", "tab:green", "tab:red",
                                                         "tab:pink", "tab:brown"]))  # fmt: skip
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        first = next(iter(mine[0]["ppl"]))
        ax.axhline(mine[0]["ppl"][first], color="black", linestyle="--", label="source")
        for method, color in colors.items():
            pts = sorted((r["kv"], r["ppl"][first]) for r in mine if r["method"] == method)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color, label=method)
            healed = sorted((r["kv"], r["healed"][first]) for r in mine if r["method"] == method and r["healed"])
            if healed:
                ax.plot(*zip(*healed), marker="*", color=color, linestyle=":", label=f"{method}, healed")
        ax.set(xlabel="KV cache bytes per token (fp16, all layers)", ylabel=f"perplexity ({first})", title=model)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
