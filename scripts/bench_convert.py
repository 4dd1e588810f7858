"""Conversion quality: what each target and method keeps of the source, and what it costs.

    .venv/bin/python scripts/bench_convert.py PART [options]     # PART --help: its options

Parts:
    quality         closed form, + layer-by-layer reconstruction, + healing, per target: perplexity on held-out
                    texts, KL, KV bytes, CPU and wall time (rows and plot: scripts/results/conversion/quality.*)
    budgets         KV budgets by measured sensitivity vs uniform and energy rank allocation
    deepseek-export the `--format deepseek_v3` export against the native MLA model it comes from
    deepseek-split  uniform latent / RoPE splits of the deepseek_v3 export against the native per-layer conversion

The held-out texts (never calibrated, healed or chosen on): stories260k on the last 60,000 characters of the
TinyStories sample (8 x 256) and tinyshakespeare (first 100,000 characters, 8 x 256); SmolLM2-135M on WikiText-2
test (first 200,000 characters, 4 x 512) and tinyshakespeare (4 x 512). Memory against depth: bench_memory.py.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.export.deepseek_export import to_deepseek_v3
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.converters.stages.heal import distill, heal_layerwise
from hf_attn_patch.converters.stages.layers import write_native
from hf_attn_patch.converters.stages.plan import plan_layers
from hf_attn_patch.converters.stages.source import open_source
from hf_attn_patch.converters.stages.target import resolve_target
from hf_attn_patch.converters.stages.windows import calibrate
from hf_attn_patch.evaluation.perplexity import evaluate, windows_of
from hf_attn_patch.kv_memory import kv_cache_bytes
from hf_attn_patch.models.pretrained import load_source

import benchlib

# ------------------------------------------------------------------------------------------------------------- quality
MODELS = {"stories260k": "default", "smollm2": "smollm2"}
LABELS = {"default": "stories260k", "smollm2": "SmolLM2-135M"}
METHODS = {"gqa": ("mean", "aligned", "pca"), "mla": ("mha2mla", "calibrated")}
DEFAULT = {"gqa": "pca", "mla": "calibrated"}
TARGETS = {
    "default": [
        ("GQA 4->2", dict(to="gqa", kv_heads=2)),
        ("MQA 4->1", dict(to="mqa")),
        ("MLA 50%", dict(to="mla", kv_budget=0.5)),
        ("MLA 25%", dict(to="mla", kv_budget=0.25)),
    ],
    "smollm2": [
        ("MLA 50%", dict(to="mla", kv_budget=0.5)),
        ("MLA 25%", dict(to="mla", kv_budget=0.25)),
        ("MQA 3->1", dict(to="mqa")),
        ("MLA 12.5%", dict(to="mla", kv_budget=0.125)),
    ],
}
HEAL = {
    "default": (100, 4),
    "smollm2": (50, 2),
}  # steps, windows per step (SmolLM2: the recipe whose time BENCHMARKS.md reports)


def eval_sets(name: str, tokenizer) -> dict[str, torch.Tensor]:
    shakespeare = benchlib.corpus("tinyshakespeare")[:100_000]
    if name == "default":
        stories = benchlib.corpus("tinystories_sample")[-60_000:]
        return {
            "stories": windows_of(stories, tokenizer, 256, 2048),
            "shakespeare": windows_of(shakespeare, tokenizer, 256, 2048),
        }
    wiki = benchlib.corpus("wikitext2_test")[:200_000]
    return {
        "wikitext2": windows_of(wiki, tokenizer, 512, 2048),
        "shakespeare": windows_of(shakespeare, tokenizer, 512, 2048),
    }


def quality_options(parser) -> None:
    parser.add_argument("--models", default="stories260k,smollm2", help="comma-separated: stories260k, smollm2")
    parser.add_argument(
        "--targets", help="comma-separated target labels to run (default: all), e.g. 'MLA 50%%,MQA 3->1'"
    )
    parser.add_argument("--all-methods", action="store_true", help="also every other closed-form method")
    parser.add_argument("--quick", action="store_true", help="stories260k only")
    parser.add_argument(
        "--reconstruct-steps",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="the CLI default (auto: 60 at >= half the KV values, 150 below)",
    )
    parser.add_argument("--heal-steps", type=int, help="default: 100 (stories260k) / 60 (SmolLM2); 0: no healing")
    parser.add_argument("--heal-data", default="teacher", choices=["calib", "teacher", "mix"])
    parser.add_argument(
        "--rank-allocation",
        help="MLA targets: convert()'s rank_allocation (default: convert()'s, sensitivity with a KV budget)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU seconds sum over threads)")
    parser.add_argument(
        "--out", default=str(benchlib.RESULTS / "conversion" / "quality.png"), help="PNG of perplexity vs KV bytes"
    )
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the rows saved next to it")


def quality(args):
    """Conversion quality: closed form, + layer-by-layer reconstruction, + healing, per target, in one run.

        .venv/bin/python scripts/bench_convert.py quality [--models stories260k,smollm2] [--targets "MLA 50%,MQA 3->1"]
            [--all-methods] [--reconstruct-steps N] [--heal-steps N] [--quick] [--out scripts/results/conversion/quality.png]

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
    rows_file = Path(args.out).with_suffix(".json")
    if args.plot_only:
        quality_plot(json.loads(rows_file.read_text()), args.out)
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
        rows.append(
            dict(
                model=label,
                target="source",
                method="-",
                kv=kv_cache_bytes(source.config, 1),
                ppl=base,
                ratio={k: 1.0 for k in base},
                kl=0.0,
                cpu=0.0,
                wall=0.0,
            )
        )
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
            runs += [
                (f"{method}, closed form (text)", dict(method=method)),
                (f"{method}, closed form (teacher)", dict(method=method, calib_source="teacher")),
                (
                    f"{method} + reconstruction",
                    dict(method=method, calib_source="teacher", reconstruct_steps=args.reconstruct_steps),
                ),
            ]
            for run_label, extra in runs:
                healing = steps and "reconstruction" in run_label
                opts = {**options, **extra}
                if healing and samples is None:  # the teacher windows convert() calibrated on: same seed, same text
                    defaults = ConvertOptions.from_flat(**opts)
                    text = calibration_windows(
                        read_calibration_text(None),
                        tokenizer,
                        defaults.calibration.samples,
                        defaults.calibration.length,
                    )
                    samples = teacher_windows(source, text, seed=0, progress=False)
                row = quality_run(
                    name,
                    opts,
                    sets,
                    source,
                    first,
                    base,
                    dict(heal_steps=steps, heal_batch_size=batch, heal_data=args.heal_data) if healing else None,
                    samples,
                    tokenizer,
                )
                for kind, r in (("one-shot", row), ("healed", row.pop("healed", None))):
                    if r is None:
                        continue
                    rows.append(
                        dict(
                            model=label, target=target, method=run_label + (", healed" if kind == "healed" else ""), **r
                        )
                    )
                    print(
                        f"  {target:<9} {rows[-1]['method']:<40} {r['kv']:>6} B  ppl {_fmt(r['ppl'])} "
                        f"(x{_fmt(r['ratio'])})  KL {r['kl']:.3f}  {r['cpu']:.0f} CPU s  {r['wall']:.0f} s",
                        flush=True,
                    )
                benchlib.write_rows(rows_file, rows)
    names = sorted({k for r in rows for k in r["ppl"]}, key=lambda k: k != "stories" and k != "wikitext2")
    print(
        "\n| model | target | method | KV B/token | "
        + " | ".join(f"ppl {k} (ratio)" for k in names)
        + " | KL | CPU s | wall s |"
    )
    print("|---|---|---|---:|" + "---:|" * len(names) + "---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['target']} | {r['method']} | {r['kv']} | "
            + " | ".join(f"{r['ppl'][k]:.2f} ({r['ratio'][k]:.2f}x)" for k in names if k in r["ppl"])
            + f" | {r['kl']:.3f} | {r['cpu']:.0f} | {r['wall']:.0f} |"
        )
    benchlib.write_rows(rows_file, rows)
    quality_plot(rows, args.out)


def _fmt(values: dict) -> str:
    return " / ".join(f"{v:.2f}" for v in values.values())


def quality_measure(model, sets, source, first, base) -> dict:
    ppl = {k: evaluate(model, w, progress=False).perplexity for k, w in sets.items()}
    kl = evaluate(model, sets[first], reference=source, progress=False).kl_to_reference
    return dict(ppl=ppl, ratio={k: ppl[k] / base[k] for k in ppl}, kl=kl)


def quality_run(name, options, sets, source, first, base, heal, samples, tokenizer) -> dict:
    """Convert (one-shot) and evaluate; with `heal`, heal that output (convert()'s healing step, the CPU seconds of
    the healing alone) and evaluate it as row["healed"]."""
    with tempfile.TemporaryDirectory() as tmp:
        cpu, wall = time.process_time(), time.perf_counter()
        report = convert(name, Path(tmp) / "out", **options)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out").eval()
        kv = report["kv_bytes_per_token_fp16"]["after"]
        row = dict(
            kv=kv,
            **quality_measure(model, sets, source, first, base),
            cpu=cpu,
            wall=wall,
            layer_error=report.get("layerwise", {}).get("mean_error"),
        )
        if heal:
            opts = ConvertOptions.from_flat(**options, **heal)
            heal_cpu, heal_wall = time.process_time(), time.perf_counter()
            if opts.healing.layerwise_steps:  # convert()'s first healing stage, on its calibration windows
                heal_layerwise(source, model, samples, opts.healing.layerwise_steps)
            healed = distill(model, source, tokenizer, opts, samples)
            heal_cpu, heal_wall = time.process_time() - heal_cpu, time.perf_counter() - heal_wall
            row["healed"] = dict(
                kv=kv,
                **quality_measure(model, sets, source, first, base),
                cpu=cpu + heal_cpu,
                wall=wall + heal_wall,
                heal_cpu=heal_cpu,
                heal_lr=healed["lr"],
                heal_best_step=healed["best_step"],
                heal_held_in_kl=healed["held_in_kl"],
            )
    return row


def quality_plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    kinds = [
        ("closed form (text)", "tab:orange"),
        ("closed form (teacher)", "tab:blue"),
        ("+ reconstruction", "tab:red"),
        ("healed", "tab:green"),
    ]
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        first = next(iter(mine[0]["ppl"]))
        ax.axhline(mine[0]["ppl"][first], color="black", linestyle="--", label="source")
        for kind, color in kinds:
            match = [
                r
                for r in mine
                if r["method"] != "-"
                and (
                    r["method"].endswith("healed")
                    if kind == "healed"
                    else kind in r["method"] and not r["method"].endswith("healed")
                )
            ]
            for family, style in (("MLA", "-"), ("GQA/MQA", ":")):  # one line per family: they share KV sizes
                pts = sorted(
                    (r["kv"], r["ppl"][first]) for r in match if r["target"].startswith("MLA") == (family == "MLA")
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=color, linestyle=style, label=f"{kind}, {family}")
            if kind in ("+ reconstruction", "healed"):  # what each costs: wall minutes beside its point
                for r in match:
                    if "wall" in r:  # rows saved before wall times were recorded have none
                        ax.annotate(
                            f"{r['wall'] / 60:.1f} min",
                            (r["kv"], r["ppl"][first]),
                            fontsize=6,
                            color=color,
                            xytext=(3, 3),
                            textcoords="offset points",
                        )
        ax.set(xlabel="KV cache bytes per token (fp16, all layers)", ylabel=f"perplexity ({first})", title=model)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


# ------------------------------------------------------------------------------------------------------------- budgets
def budgets_options(parser) -> None:
    parser.add_argument("--models", default="default,smollm2")
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--allocations", default="uniform,energy,sensitivity")
    parser.add_argument("--reconstruct-steps", type=int, default=0)
    parser.add_argument("--calib-source", default="text", help="text (convert()'s default) or teacher (the CLI's)")
    parser.add_argument("--json", help="write the rows here")


def budgets(args):
    """KV budgets by measured sensitivity vs uniform and energy rank allocation, in one run.

        OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_convert.py budgets [--models default,smollm2] [--budgets 0.5,0.25]
            [--allocations uniform,energy,sensitivity] [--reconstruct-steps 0] [--calib-source text] [--json rows.json]

    Per model, budget and allocation: `convert(..., to="mla", kv_budget=F, rank_allocation=A)` (method calibrated,
    calibration on the package corpus, first 16 x 256 tokens; the sensitivity KL on its first 4 windows), then
    perplexity on texts never calibrated on, KL(source || converted) per token on the first, KV bytes per token (fp16,
    all layers, from the saved config) and the conversion's CPU seconds (time.process_time of this process).
    Evaluation as the quality part: stories260k on the last 60,000 characters of the TinyStories sample (8 x 256)
    and tinyshakespeare (first 100,000 characters, 8 x 256); SmolLM2-135M on WikiText-2 test (first 200,000 characters,
    4 x 512) and tinyshakespeare (4 x 512). The per-layer choices (RoPE dims + latent rank, or unconverted) are printed.
    """
    rows = []
    for name in args.models.split(","):
        source, tokenizer = load_source(name)
        sets = eval_sets(name, tokenizer)
        first = next(iter(sets))
        base = {k: evaluate(source, w, progress=False).perplexity for k, w in sets.items()}
        print(f"{LABELS[name]}: source ppl {_fmt(base)}  KV {kv_cache_bytes(source.config, 1)} B/token", flush=True)
        rows.append(
            dict(
                model=LABELS[name],
                budget=1.0,
                allocation="source",
                ppl=base,
                kl=0.0,
                kv=kv_cache_bytes(source.config, 1),
                cpu=0.0,
                layers=None,
            )
        )
        for budget in map(float, args.budgets.split(",")):
            for allocation in args.allocations.split(","):
                row = budget_run(
                    name, budget, allocation, args.reconstruct_steps, args.calib_source, sets, source, first
                )
                rows.append(dict(model=LABELS[name], budget=budget, allocation=allocation, **row))
                print(
                    f"  MLA {budget:.0%} {allocation:<12} steps {args.reconstruct_steps:<4} {row['kv']:>6} B  "
                    f"ppl {_fmt(row['ppl'])}  KL {row['kl']:.4f}  {row['cpu']:.0f} s CPU",
                    flush=True,
                )
                if row["layers"]:
                    print(f"    layers (d_r+d_c): {row['layers']}", flush=True)
    names = sorted({k for r in rows for k in r["ppl"]}, key=lambda k: k not in ("stories", "wikitext2"))
    print(f"\ncalibration: {args.calib_source}")
    print(
        "\n| model | KV budget | allocation | reconstruct steps | KV B/token | "
        + " | ".join(f"ppl {k}" for k in names)
        + " | KL | convert CPU s |"
    )
    print("|---|---:|---|---:|---:|" + "---:|" * len(names) + "---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['budget']:.0%} | {r['allocation']} | {args.reconstruct_steps} | {r['kv']} | "
            + " | ".join(f"{r['ppl'][k]:.2f}" if k in r["ppl"] else "-" for k in names)
            + f" | {r['kl']:.4f} | {r['cpu']:.0f} |"
        )
    if args.json:
        benchlib.write_rows(args.json, rows)


def budget_run(name, budget, allocation, steps, calib_source, sets, source, first) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cpu = time.process_time()
        report = convert(
            name,
            Path(tmp) / "out",
            to="mla",
            kv_budget=budget,
            rank_allocation=allocation,
            reconstruct_steps=steps,
            calib_source=calib_source,
        )
        cpu = time.process_time() - cpu
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out").eval()
        kv = kv_cache_bytes(model.config, 1)
        assert kv == report["kv_bytes_per_token_fp16"]["after"], (kv, report["kv_bytes_per_token_fp16"])
        ppl = {k: evaluate(model, w, progress=False).perplexity for k, w in sets.items()}
        kl = evaluate(model, sets[first], reference=source, progress=False).kl_to_reference
    layers = None
    if "budgets" in report:
        layers = " ".join(
            "exact" if c["choice"] != "mla" else f"{c['rope_dim']}+{c['kv_lora_rank']}"
            for c in report["budgets"]["layers"]
        )
    elif allocation == "energy":
        layers = " ".join(f"{report['mla']['qk_rope_head_dim']}+{r}" for r in report["mla"]["kv_lora_rank_per_layer"])
    return dict(ppl=ppl, kl=kl, kv=kv, cpu=cpu, layers=layers)


# ----------------------------------------------------------------------------------------------------- deepseek-export
def native_conversion(source: str, options: dict):
    """(the native MLA model the export starts from, its calibration windows, the RoPE stride, the source's config,
    the engine, the export's RoPE dims): convert()'s stages with the layer loop's native form written to a temporary
    folder and loaded whole."""
    from transformers import AutoModelForCausalLM

    opts = ConvertOptions.from_flat(**options)
    src = open_source(source, opts.device)
    target = resolve_target(src, opts)
    opts = target.options  # with the choices resolved from the source
    src.layers.load_resident()  # embedding, final norm, LM head: convert() loads them once the target is checked
    cal = calibrate(src, opts, True)
    plan = plan_layers(src, opts, target, cal.windows)
    with tempfile.TemporaryDirectory() as tmp:
        write_native(src, opts, target, cal.windows, plan, f"{tmp}/native")
        native = AutoModelForCausalLM.from_pretrained(f"{tmp}/native").eval()
    return native, cal.windows, plan.stride, src.config, opts.engine, target.export_rope


def deepseek_export_options(parser) -> None:
    parser.add_argument("source")
    parser.add_argument("--kv-budget", type=float, required=True)
    parser.add_argument("--text", required=True, help="held-out evaluation text")
    parser.add_argument("--skip-chars", type=int, default=0, help="characters of the text skipped (calibration's part)")
    parser.add_argument("--chars", type=int, default=None, help="characters of the text kept after the skip")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--no-half", action="store_true", help="skip the bf16 / fp16 evaluations")
    parser.add_argument("--calib-source", default="teacher", help="as hf-attn convert (default teacher)")
    parser.add_argument("--reconstruct-steps", default="auto", help="as hf-attn convert (default auto)")


def deepseek_export(args):
    """The `--format deepseek_v3` export against the native MLA model it comes from: perplexity on held-out text and
    KL(native || export) per token, for both latent-norm forms (linear: the scaled latent; fit: least squares), the eps
    change alone (rms_norm_eps 1e-6 without the residual rescale), and the linear export in bf16 and fp16.

        python scripts/bench_convert.py deepseek-export smollm2 --kv-budget 0.5 --text wikitext2_test.txt --chars 200000 --ctx 512 --windows 4
        python scripts/bench_convert.py deepseek-export stories15m_dir --kv-budget 0.5 --text tinystories.txt --skip-chars 100000 --ctx 256 --windows 8

    The conversion uses the CLI's defaults (teacher calibration windows from the package corpus, reconstruction "auto")
    unless --calib-source / --reconstruct-steps say otherwise;
    the evaluation text is never used to choose anything. Prints one JSON object.
    """

    options = dict(
        to="mla",
        kv_budget=args.kv_budget,
        format="deepseek_v3",
        calib_source=args.calib_source,
        reconstruct_steps=args.reconstruct_steps if args.reconstruct_steps == "auto" else int(args.reconstruct_steps),
    )
    native, calib, stride, config, engine, rope_dim = native_conversion(args.source, options)
    linear, lin_report = to_deepseek_v3(native, calib, stride, config, engine, rope_dim, "linear")
    fit, fit_report = to_deepseek_v3(native, calib, stride, config, engine, rope_dim, "fit")

    source, tokenizer = load_source(args.source)
    text = open(args.text, encoding="utf-8").read()[args.skip_chars :]
    text = text[: args.chars] if args.chars else text
    windows = windows_of(text, tokenizer, args.ctx, args.ctx * args.windows)

    def ev(model, reference=native):
        r = evaluate(model, windows, reference=reference, progress=False)
        return {"ppl": r.perplexity, "kl_to_native": r.kl_to_reference}

    # the eps change alone: the linear export with the residual rescale undone (all norms at eps 1e-6)
    eps_only = copy.deepcopy(linear)
    k = lin_report["eps"]["residual_scale"]
    with torch.no_grad():
        eps_only.model.embed_tokens.weight /= k
        for layer in eps_only.model.layers:
            layer.self_attn.o_proj.weight /= k
            layer.mlp.down_proj.weight /= k
    out = {
        "source": args.source,
        "kv_budget": args.kv_budget,
        "shape": lin_report["shape"],
        "eval": {
            "text": args.text,
            "skip_chars": args.skip_chars,
            "chars": args.chars,
            "windows": len(windows),
            "ctx": args.ctx,
        },
        "source_ppl": evaluate(source, windows, progress=False).perplexity,
        "native": ev(native),
        "export_linear": {
            **ev(linear),
            "calib_kl": lin_report["kl_to_native_per_token"],
            "max_relative_deviation": lin_report["latent_norm"]["max_relative_deviation_calibration"],
        },
        "export_fit": {**ev(fit), "calib_kl": fit_report["kl_to_native_per_token"]},
        "eps_change_only": ev(eps_only),
    }
    for name in ("export_linear", "export_fit"):
        out[name]["ppl_vs_native"] = out[name]["ppl"] / out["native"]["ppl"]
    if args.no_half:
        print(json.dumps(out, indent=1))
        return
    native_bf16 = copy.deepcopy(native).to(torch.bfloat16)
    out["bf16"] = {
        "native_bf16": ev(native_bf16),
        "export_linear_bf16": ev(copy.deepcopy(linear).to(torch.bfloat16)),
        "export_linear_bf16_vs_native_bf16": ev(copy.deepcopy(linear).to(torch.bfloat16), native_bf16),
    }
    fp16 = ev(copy.deepcopy(linear).to(torch.float16))
    out["fp16_export_linear"] = {k: (v if math.isfinite(v) else str(v)) for k, v in fp16.items()}
    print(json.dumps(out, indent=1))


# ------------------------------------------------------------------------------------------------------ deepseek-split
def deepseek_split_options(parser) -> None:
    parser.add_argument("source", help="a model folder or name")
    parser.add_argument("budget", help="the KV budget, a share of the source's KV bytes")
    parser.add_argument("text_file", help="the held-out text (read after its first 100,000 characters)")
    parser.add_argument("rope_dims", nargs="*", help="the deepseek_v3 RoPE dims d_r to convert with")


def deepseek_split(args):
    """Uniform latent / RoPE splits of the deepseek_v3 export against the native per-layer (sensitivity) conversion, at
    one KV budget: KL to the source on the calibration windows (what a choice may use) and perplexity / KL on held-out
    TinyStories text (the sample after its first 100,000 characters). Closed forms (text calibration, no
    reconstruction). Prints one JSON line per conversion.

        python scripts/bench_convert.py deepseek-split $DATA/models/stories15m 0.5 $DATA/corpora/tinystories_sample.txt 16 32 48
    """
    source, budget, text_file, rope_dims = args.source, args.budget, args.text_file, args.rope_dims
    model, tokenizer = load_source(source)
    calib = calibration_windows(read_calibration_text(None), tokenizer, 8, 256)
    held_out = windows_of(open(text_file, encoding="utf-8").read()[100_000:], tokenizer, 256, 256 * 8)
    runs = [("native sensitivity", dict(rank_allocation="sensitivity"))]
    runs += [(f"deepseek_v3 d_r {r}", dict(format="deepseek_v3", rope_dim=int(r))) for r in rope_dims]
    for name, options in runs:
        with tempfile.TemporaryDirectory() as tmp:
            convert(
                source,
                f"{tmp}/out",
                to="mla",
                kv_budget=float(budget),
                calib_samples=8,
                calib_source="text",
                reconstruct_steps=0,
                **options,
            )
            converted = AutoModelForCausalLM.from_pretrained(f"{tmp}/out").eval()
        held = evaluate(converted, held_out, reference=model, progress=False)
        calib_kl = evaluate(converted, calib, reference=model, progress=False).kl_to_reference
        row = {"run": name, "calib_kl": calib_kl, "held_out_ppl": held.perplexity, "held_out_kl": held.kl_to_reference}
        print(json.dumps(row), flush=True)


PARTS: dict[str, benchlib.Part] = {
    "quality": (quality_options, quality),
    "budgets": (budgets_options, budgets),
    "deepseek-export": (deepseek_export_options, deepseek_export),
    "deepseek-split": (deepseek_split_options, deepseek_split),
}

if __name__ == "__main__":
    benchlib.run_parts(__doc__, PARTS)
