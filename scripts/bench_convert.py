"""Conversion quality: closed form, + layer-by-layer reconstruction, + healing, per target, in one run.

    .venv/bin/python scripts/bench_convert.py [--models stories260k,smollm2] [--targets "MLA 50%,MQA 3->1"]
        [--all-methods] [--reconstruct-steps N] [--heal-steps N] [--quick] [--out scripts/bench_convert.png]

For each model and target: perplexity on two evaluation texts that are never calibrated or healed on (and its ratio
to the source's), mean KL(source || converted) per token on the first, KV bytes per token (fp16, all layers), and
the CPU seconds of the conversion (time.process_time of this process, one torch thread unless --threads: on a shared
machine the wall time is noise, the CPU time less so) and its wall time (beside each point of the PNG, in minutes).
Rows per target:
    closed form (text)     the default method calibrated on the package corpus (TinyStories sample, 32 x 256 tokens)
    closed form (teacher)  the same calibrated on 32 x 256 samples of the source itself (calib_source="teacher")
    + reconstruction       teacher calibration and `--reconstruct-steps` Adam steps per layer (convert()'s path)
    + healing              convert()'s healing (the layer-wise first stage, then `--heal-steps` of KL, heal data
                           `--heal-data`, lr "auto", best held-in state) applied to the reconstructed output, on the
                           same teacher windows
    --all-methods adds every other closed-form method (text calibration), as the older tables had; MLA rows use
    `--rank-allocation` (default: convert()'s, measured sensitivity with a KV budget).
Evaluation: stories260k on the last 60,000 characters of the TinyStories sample (8 x 256 tokens) and tinyshakespeare
(first 100,000 characters, 8 x 256); SmolLM2-135M on WikiText-2 test (first 200,000 characters, 4 x 512) and
tinyshakespeare (4 x 512). Every setting was chosen on held-in calibration / teacher windows, never on these texts.
Rows are written to the JSON beside the PNG after each one (a partial run keeps what it measured); --plot-only
redraws the PNG. --quick: stories260k only.
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
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.stages.heal import distill, heal_layerwise
from hf_attn_patch.models.pretrained import load_source
from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.evaluation.perplexity import evaluate, windows_of
from hf_attn_patch.kv_memory import kv_cache_bytes

CORPORA = Path(__file__).resolve().parents[2] / "shared" / "corpora"
MODELS = {"stories260k": "default", "smollm2": "smollm2"}
LABELS = {"default": "stories260k", "smollm2": "SmolLM2-135M"}
METHODS = {"gqa": ("mean", "aligned", "pca"), "mla": ("mha2mla", "calibrated")}
DEFAULT = {"gqa": "pca", "mla": "calibrated"}
TARGETS = {
    "default": [("GQA 4->2", dict(to="gqa", kv_heads=2)), ("MQA 4->1", dict(to="mqa")),
                ("MLA 50%", dict(to="mla", kv_budget=0.5)), ("MLA 25%", dict(to="mla", kv_budget=0.25))],
    "smollm2": [("MLA 50%", dict(to="mla", kv_budget=0.5)), ("MLA 25%", dict(to="mla", kv_budget=0.25)),
                ("MQA 3->1", dict(to="mqa")), ("MLA 12.5%", dict(to="mla", kv_budget=0.125))],
}  # fmt: skip
HEAL = {"default": (100, 4), "smollm2": (50, 2)}  # steps, windows per step (SmolLM2: the recipe whose time BENCHMARKS.md reports)


def eval_sets(name: str, tokenizer) -> dict[str, torch.Tensor]:
    shakespeare = (CORPORA / "tinyshakespeare.txt").read_text()[:100_000]
    if name == "default":
        stories = (CORPORA / "tinystories_sample.txt").read_text()[-60_000:]
        return {"stories": windows_of(stories, tokenizer, 256, 2048), "shakespeare": windows_of(shakespeare, tokenizer, 256, 2048)}
    wiki = (CORPORA / "wikitext2_test.txt").read_text()[:200_000]
    return {"wikitext2": windows_of(wiki, tokenizer, 512, 2048), "shakespeare": windows_of(shakespeare, tokenizer, 512, 2048)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="stories260k,smollm2", help="comma-separated: stories260k, smollm2")
    parser.add_argument("--targets", help="comma-separated target labels to run (default: all), e.g. 'MLA 50%%,MQA 3->1'")
    parser.add_argument("--all-methods", action="store_true", help="also every other closed-form method")
    parser.add_argument("--quick", action="store_true", help="stories260k only")
    parser.add_argument("--reconstruct-steps", type=lambda v: v if v == "auto" else int(v), default="auto",
                        help="the CLI default (auto: 60 at >= half the KV values, 150 below)")
    parser.add_argument("--heal-steps", type=int, help="default: 100 (stories260k) / 60 (SmolLM2); 0: no healing")
    parser.add_argument("--heal-data", default="teacher", choices=["calib", "teacher", "mix"])
    parser.add_argument("--rank-allocation", help="MLA targets: convert()'s rank_allocation (default: convert()'s, "
                        "sensitivity with a KV budget)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU seconds sum over threads)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")), help="PNG of perplexity vs KV bytes")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the rows saved next to it")
    args = parser.parse_args()
    rows_file = Path(args.out).with_suffix(".json")
    if args.plot_only:
        _plot(json.loads(rows_file.read_text()), args.out)
        return
    models = ["stories260k"] if args.quick else [m.strip() for m in args.models.split(",")]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: {m!r} is not one of {sorted(MODELS)}")
    wanted = None if args.targets is None else {t.strip() for t in args.targets.split(",")}
    torch.set_num_threads(args.threads)
    rows = []
    for name in (MODELS[m] for m in models):
        label = LABELS[name]
        source, tokenizer = load_source(name)
        sets = eval_sets(name, tokenizer)
        first = next(iter(sets))
        base = {k: evaluate(source, w, progress=False).perplexity for k, w in sets.items()}
        rows.append(dict(model=label, target="source", method="-", kv=kv_cache_bytes(source.config, 1), ppl=base,
                         ratio={k: 1.0 for k in base}, kl=0.0, cpu=0.0, wall=0.0))  # fmt: skip
        print(f"{label}: source {_fmt(base)}", flush=True)
        steps, batch = HEAL[name]
        steps = steps if args.heal_steps is None else args.heal_steps
        samples = None
        for target, options in TARGETS[name]:
            if wanted is not None and target not in wanted:
                continue
            family = "mla" if options["to"] == "mla" else "gqa"
            if family == "mla" and args.rank_allocation:
                options = {**options, "rank_allocation": args.rank_allocation}
            method = DEFAULT[family]
            runs = [(m, dict(method=m)) for m in METHODS[family] if args.all_methods and m != method]
            runs += [(f"{method}, closed form (text)", dict(method=method)),
                     (f"{method}, closed form (teacher)", dict(method=method, calib_source="teacher")),
                     (f"{method} + reconstruction", dict(method=method, calib_source="teacher",
                                                         reconstruct_steps=args.reconstruct_steps))]  # fmt: skip
            for run_label, extra in runs:
                healing = steps and "reconstruction" in run_label
                opts = {**options, **extra}
                if healing and samples is None:  # the teacher windows convert() calibrated on: same seed, same text
                    defaults = ConvertOptions.from_flat(**opts)
                    text = calibration_windows(read_calibration_text(None), tokenizer, defaults.calibration.samples,
                                               defaults.calibration.length)  # fmt: skip
                    samples = teacher_windows(source, text, seed=0, progress=False)
                row = _run(name, opts, sets, source, first, base,
                           dict(heal_steps=steps, heal_batch_size=batch, heal_data=args.heal_data) if healing else None,
                           samples, tokenizer)  # fmt: skip
                for kind, r in (("one-shot", row), ("healed", row.pop("healed", None))):
                    if r is None:
                        continue
                    rows.append(dict(model=label, target=target, method=run_label + (", healed" if kind == "healed" else ""), **r))
                    print(f"  {target:<9} {rows[-1]['method']:<40} {r['kv']:>6} B  ppl {_fmt(r['ppl'])} "
                          f"(x{_fmt(r['ratio'])})  KL {r['kl']:.3f}  {r['cpu']:.0f} CPU s  {r['wall']:.0f} s",
                          flush=True)  # fmt: skip
                rows_file.write_text(json.dumps(rows, indent=1))
    names = sorted({k for r in rows for k in r["ppl"]}, key=lambda k: k != "stories" and k != "wikitext2")
    print("\n| model | target | method | KV B/token | " + " | ".join(f"ppl {k} (ratio)" for k in names)
          + " | KL | CPU s | wall s |")
    print("|---|---|---|---:|" + "---:|" * len(names) + "---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['target']} | {r['method']} | {r['kv']} | "
              + " | ".join(f"{r['ppl'][k]:.2f} ({r['ratio'][k]:.2f}x)" for k in names if k in r["ppl"])
              + f" | {r['kl']:.3f} | {r['cpu']:.0f} | {r['wall']:.0f} |")  # fmt: skip
    rows_file.write_text(json.dumps(rows, indent=1))
    _plot(rows, args.out)


def _fmt(values: dict) -> str:
    return " / ".join(f"{v:.2f}" for v in values.values())


def _measure(model, sets, source, first, base) -> dict:
    ppl = {k: evaluate(model, w, progress=False).perplexity for k, w in sets.items()}
    kl = evaluate(model, sets[first], reference=source, progress=False).kl_to_reference
    return dict(ppl=ppl, ratio={k: ppl[k] / base[k] for k in ppl}, kl=kl)


def _run(name, options, sets, source, first, base, heal, samples, tokenizer) -> dict:
    """Convert (one-shot) and evaluate; with `heal`, heal that output (convert()'s healing step, the CPU seconds of
    the healing alone) and evaluate it as row["healed"]."""
    with tempfile.TemporaryDirectory() as tmp:
        cpu, wall = time.process_time(), time.perf_counter()
        report = convert(name, Path(tmp) / "out", **options)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out").eval()
        kv = report["kv_bytes_per_token_fp16"]["after"]
        row = dict(kv=kv, **_measure(model, sets, source, first, base), cpu=cpu, wall=wall,
                   layer_error=report.get("layerwise", {}).get("mean_error"))  # fmt: skip
        if heal:
            opts = ConvertOptions.from_flat(**options, **heal)
            heal_cpu, heal_wall = time.process_time(), time.perf_counter()
            if opts.healing.layerwise_steps:  # convert()'s first healing stage, on its calibration windows
                heal_layerwise(source, model, samples, opts.healing.layerwise_steps)
            healed = distill(model, source, tokenizer, opts, samples)
            heal_cpu, heal_wall = time.process_time() - heal_cpu, time.perf_counter() - heal_wall
            row["healed"] = dict(kv=kv, **_measure(model, sets, source, first, base), cpu=cpu + heal_cpu,
                                 wall=wall + heal_wall, heal_cpu=heal_cpu, heal_lr=healed["lr"],
                                 heal_best_step=healed["best_step"], heal_held_in_kl=healed["held_in_kl"])  # fmt: skip
    return row


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    kinds = [("closed form (text)", "tab:orange"), ("closed form (teacher)", "tab:blue"),
             ("+ reconstruction", "tab:red"), ("healed", "tab:green")]  # fmt: skip
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        first = next(iter(mine[0]["ppl"]))
        ax.axhline(mine[0]["ppl"][first], color="black", linestyle="--", label="source")
        for kind, color in kinds:
            match = [r for r in mine if r["method"] != "-" and (r["method"].endswith("healed") if kind == "healed"
                     else kind in r["method"] and not r["method"].endswith("healed"))]  # fmt: skip
            for family, style in (("MLA", "-"), ("GQA/MQA", ":")):  # one line per family: they share KV sizes
                pts = sorted((r["kv"], r["ppl"][first]) for r in match if r["target"].startswith("MLA") == (family == "MLA"))
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=color, linestyle=style, label=f"{kind}, {family}")
            if kind in ("+ reconstruction", "healed"):  # what each costs: wall minutes beside its point
                for r in match:
                    if "wall" in r:  # rows saved before wall times were recorded have none
                        ax.annotate(f"{r['wall'] / 60:.1f} min", (r["kv"], r["ppl"][first]), fontsize=6,
                                    color=color, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="KV cache bytes per token (fp16, all layers)", ylabel=f"perplexity ({first})", title=model)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
