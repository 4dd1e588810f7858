"""Zero-shot conversion quality: our methods vs the baselines, same run, same calibration, same evaluation.

    .venv/bin/python scripts/bench_convert.py [--quick] [--out bench_convert.png]

For each model and target: perplexity and mean KL(source || converted) per token on held-out text, KV bytes per
token (fp16, all layers), conversion wall time and the process's peak RSS so far. Calibration: the package corpus
(TinyStories sample, first 16 x 256 tokens) for both models. Evaluation: stories260k on the last 60,000 characters
of the TinyStories sample (never calibrated on); SmolLM2-135M on the first 200,000 characters of WikiText-2 test,
4 windows of 512 tokens. Then the same fixed healing budget for every target of a model (KL distillation from the
source on the first 120,000 characters of the calibration text, attention weights only, AdamW with warmup and
cosine decay): stories260k 100 steps of 4 x 256 tokens, the best of lr 1e-5 / 1e-4 / 1e-3 by held-out perplexity (a
close start wants a small step, a far one a large); SmolLM2-135M 50 steps of 2 x 256 tokens at lr 1e-4.
The "(deepseek_v3)" rows are the same calibrated conversion exported as a stock DeepSeek-V3 model (fitted latent
norm, stride-matched RoPE frequencies). Writes a PNG of perplexity vs KV bytes. --quick: stories260k only.
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
from hf_attn_patch.converters.calibration import calibration_windows, read_calibration_text
from hf_attn_patch.converters.convert import convert, load_source
from hf_attn_patch.converters.evaluate import evaluate, windows_of
from hf_attn_patch.converters.heal import heal
from hf_attn_patch.kv_memory import kv_cache_bytes

CORPORA = Path(__file__).resolve().parents[2] / "shared" / "corpora"

DEEPSEEK = dict(format="deepseek_v3")  # the stock DeepSeek-V3 export of the same conversion (latent norm fitted)
TARGETS = {
    "default": [
        *(("GQA 4->2", dict(to="gqa", kv_heads=2, method=m)) for m in ("mean", "aligned", "pca")),
        *(("MQA 4->1", dict(to="mqa", method=m)) for m in ("mean", "aligned", "pca")),
        ("MLA 50%", dict(to="mla", kv_budget=0.5, method="mha2mla")),
        ("MLA 50%", dict(to="mla", kv_budget=0.5, method="calibrated")),
        ("MLA 50%", dict(to="mla", kv_budget=0.5, method="calibrated", **DEEPSEEK)),
        ("MLA 25%", dict(to="mla", kv_budget=0.25, method="mha2mla")),
        ("MLA 25%", dict(to="mla", kv_budget=0.25, method="calibrated")),
        ("MLA 25%", dict(to="mla", kv_budget=0.25, method="calibrated", **DEEPSEEK)),
    ],
    "smollm2": [
        *(("MQA 3->1", dict(to="mqa", method=m)) for m in ("mean", "aligned", "pca")),
        ("MLA 50%", dict(to="mla", kv_budget=0.5, method="mha2mla")),
        ("MLA 50%", dict(to="mla", kv_budget=0.5, method="calibrated")),
        ("MLA 50%", dict(to="mla", kv_budget=0.5, method="calibrated", **DEEPSEEK)),
        ("MLA 25%", dict(to="mla", kv_budget=0.25, method="mha2mla")),
        ("MLA 25%", dict(to="mla", kv_budget=0.25, method="calibrated")),
        ("MLA 12.5%", dict(to="mla", kv_budget=0.125, method="mha2mla")),
        ("MLA 12.5%", dict(to="mla", kv_budget=0.125, method="calibrated")),
    ],
}


HEALING = {  # model -> (steps, batch, learning rates tried): the same budget for every target of a model
    "default": (100, 4, (1e-5, 1e-4, 1e-3)),  # a close start wants a small step, a far one a large: best of three
    "smollm2": (50, 2, (1e-4,)),  # 2 cores: one rate
}


def eval_windows(name: str, tokenizer) -> torch.Tensor:
    if name == "default":
        text = (CORPORA / "tinystories_sample.txt").read_text()[-60_000:]
        return windows_of(text, tokenizer, ctx=256, max_tokens=2048)
    text = (CORPORA / "wikitext2_test.txt").read_text()[:200_000]
    return windows_of(text, tokenizer, ctx=512, max_tokens=4 * 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")), help="PNG of perplexity vs KV bytes")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the rows saved next to it")
    args = parser.parse_args()
    rows_file = Path(args.out).with_suffix(".json")
    if args.plot_only:
        _plot([tuple(r) for r in json.loads(rows_file.read_text())], args.out)  # rows: ..., healed, lr
        return
    torch.set_num_threads(2)
    rows = []
    for name in ["default"] if args.quick else ["default", "smollm2"]:
        source, tokenizer = load_source(name)
        windows = eval_windows(name, tokenizer)
        heal_steps, heal_batch, heal_lrs = HEALING[name]
        heal_windows = calibration_windows(read_calibration_text(None)[:120_000], tokenizer, 64, 256)
        base = evaluate(source, windows, progress=False)
        base_bytes = kv_cache_bytes(source.config, 1)
        label = "stories260k" if name == "default" else "SmolLM2-135M"
        rows.append((label, "source", "-", base_bytes, base.perplexity, 0.0, 0.0, None, None))
        print(f"{label}: source perplexity {base.perplexity:.2f}, {base_bytes} KV bytes/token (fp16)", flush=True)
        for target, options in TARGETS[name]:
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                report = convert(name, Path(tmp) / "out", **options)
                seconds = time.perf_counter() - start
                converted = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out").eval()
                result = evaluate(converted, windows, reference=source, progress=False)
                healed = {}
                for lr in heal_lrs:
                    student = AutoModelForCausalLM.from_pretrained(Path(tmp) / "out").eval()
                    heal(student, source, heal_windows, steps=heal_steps, lr=lr, batch_size=heal_batch, progress=False)
                    healed[lr] = evaluate(student, windows, progress=False).perplexity
            best_lr = min(healed, key=healed.get)
            after = report["kv_bytes_per_token_fp16"]["after"]
            method = options["method"] + (" (deepseek_v3)" if options.get("format") == "deepseek_v3" else "")
            if "deepseek_v3" in report:
                print(f"  deepseek_v3 export: KL to the native conversion {report['deepseek_v3']['kl_to_native_per_token']:.4f}")
            rows.append((label, target, method, after, result.perplexity, result.kl_to_reference, seconds,
                         healed[best_lr], best_lr))  # fmt: skip
            print(f"  {target:<10} {method:<11} {after:>6} B  ppl {result.perplexity:>10.2f}  "
                  f"KL {result.kl_to_reference:6.3f}  {seconds:5.1f} s  healed ppl {healed[best_lr]:>9.2f} "
                  f"(lr {best_lr:g}; all: {healed})  peak RSS {report['peak_rss_mb']} MB", flush=True)  # fmt: skip
    print("\n| model | target | method | KV B/token | perplexity | KL to source | convert s | healed perplexity (lr) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for label, target, method, kv, ppl, kl, seconds, healed, lr in rows:
        healed_text = "-" if healed is None else f"{healed:.2f} ({lr:g})"
        print(f"| {label} | {target} | {method} | {kv} | {ppl:.2f} | {kl:.3f} | {seconds:.1f} | {healed_text} |")
    rows_file.write_text(json.dumps(rows, indent=1))
    _plot(rows, args.out)


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r[0] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        styles = (("source", "*", "black"), ("mean", "s", "tab:orange"), ("aligned", "D", "tab:blue"),
                  ("pca", "P", "tab:purple"), ("mha2mla", "o", "tab:green"), ("calibrated", "^", "tab:red"),
                  ("calibrated (deepseek_v3)", "v", "tab:brown"))  # fmt: skip
        for method, marker, color in styles:
            mine = [r for r in rows if r[0] == model and (r[2] == method or r[1] == method)]
            pts = [(r[3], r[4]) for r in mine]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker=marker, color=color, linestyle="-" if len(pts) > 1 else "",
                        label=method)  # fmt: skip
            healed = [(r[3], r[7]) for r in mine if r[7] is not None]
            if healed:
                ax.plot(*zip(*sorted(healed)), marker=marker, color=color, linestyle=":", fillstyle="none",
                        label=f"{method}, healed")  # fmt: skip
        ax.set(xlabel="KV cache bytes per token (fp16, all layers)", ylabel="perplexity (zero-shot, and healed: dotted)", title=model)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
