"""What loses retrieval in an MLA conversion: the conversion's stages added one at a time, and candidate fixes, each
measured on held-in teacher samples and on the retrieval probes.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_retrieval_levers.py [--source smollm2] [--kv-budget 0.5]
        [--items 16] [--smallest 64] [--largest 1024] [--tasks passkey,copy] [--levers closed,teacher,...]
        [--keep DIR] [--out scripts/bench_retrieval_levers.json]

Every lever states all its options (nothing rides on convert()'s defaults):
    closed          text calibration (32 x 256), uniform ranks, no reconstruction: the closed form
    teacher         + teacher-sample calibration (32 x 256 samples of the source)
    teacher_sens    + sensitivity rank allocation (per-layer RoPE dims / ranks by measured KL)
    teacher_rec60   teacher calibration, uniform ranks, reconstruction 60 steps / layer
    sens_rec20      teacher + sensitivity + reconstruction 20
    default         teacher + sensitivity + reconstruction 60: the CLI's defaults
    measure_1024    default, the sensitivity KL measured on 1024 calibration tokens (budgets.MEASURE_TOKENS; 256 in
                    the library) instead of one window
    calib_512       default, 16 x 512 calibration windows (the same 8,192 tokens; L = 512 in the RoPE score)
    calib_1024      default, 8 x 1024 windows (L = 1024)
    sens_m512       teacher_sens (no reconstruction), the sensitivity KL measured on 512 tokens (2 windows)
    sens_floor      teacher_sens (no reconstruction), no layer below 0.75 x the uniform share (budgets.SIZE_FACTORS
                    without 0.5)
    rope_context    teacher_rec60 with L = the source's context (max_position_embeddings) in the RoPE split's score
                    energy x 2(1 - sinc(theta L)) instead of the 256-token calibration window (rope_context; the
                    levers above state rope_context=256, the calibration length and the library's default)
    default_context default (sensitivity + reconstruction 60) with L = the source's context in the RoPE score
    default_l1024   default with L = 1024 in the RoPE score
    calib_1024_context  teacher_rec60 on 8 x 1024 windows with L = the source's context in the RoPE score
    attention_kl    default, the reconstruction's objective adding 1.0 x the attention-pattern KL to the source's
                    (reconstruct_attention_kl; the levers above state 0)
    attention_kl_uniform  teacher_rec60 (uniform ranks) with reconstruct_attention_kl 1.0
    recipe_attention_kl  calib_1024_context (the long-context recipe) with reconstruct_attention_kl 1.0
    calib_1024_context_sens  calib_1024_context with sensitivity ranks: the KL measured on one 1,024-token window
Held-in measure (chosen on, never the probes): mean KL(source || converted) per token on 4 samples of the source
itself, --held-in-len (2048) tokens long, prompted by calibration-corpus windows after the 8,192 tokens calibrated on;
split into positions < 256, 256-511, 512-1023 and >= 1024; "all" (every position alike) is the figure levers are
compared by. Teacher calibration samples are cached beside --out (safetensors) and reused by every lever with the
same windows and seed: after sensitivity, sampling is a conversion's costliest step on a CPU. Evaluation: retrieval
accuracy per distance (hf_attn_patch/evaluation/retrieval.py; the source's vocabulary, seed 0). --keep DIR: converted
models are kept in DIR/<lever> and reused when present; --held-in-only remeasures them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.methods import budgets
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.stages import plan as plan_stage
from hf_attn_patch.converters.stages import windows as windows_stage
from hf_attn_patch.evaluation.retrieval import RetrievalResult, evaluate_retrieval, known_vocabulary, retained
from hf_attn_patch.models.pretrained import load_source

WINDOW = 256  # the calibration length: the RoPE score's default L
CALIBRATED_TOKENS = 8192  # every lever's calibration windows hold these (32 x 256, 16 x 512, 8 x 1024)
CLOSED = {"calib_source": "text", "rank_allocation": "uniform", "reconstruct_steps": 0, "rope_context": WINDOW}
DEFAULT = {"calib_source": "teacher", "rank_allocation": "sensitivity", "reconstruct_steps": 60, "rope_context": WINDOW,
           "reconstruct_attention_kl": 0.0}
CONTEXT = {"rope_context": "source"}  # the source's max_position_embeddings
LEVERS = {
    "closed": CLOSED,
    "teacher": {**CLOSED, "calib_source": "teacher"},
    "teacher_sens": {**DEFAULT, "reconstruct_steps": 0},
    "teacher_rec60": {**DEFAULT, "rank_allocation": "uniform"},
    "sens_rec20": {**DEFAULT, "reconstruct_steps": 20},
    "default": DEFAULT,
    "measure_1024": {**DEFAULT, "measure_tokens": 1024},
    "calib_512": {**DEFAULT, "calib_len": 512, "calib_samples": 16, "rope_context": 512},
    "calib_1024": {**DEFAULT, "calib_len": 1024, "calib_samples": 8, "rope_context": 1024},
    "rope_context": {**DEFAULT, "rank_allocation": "uniform", **CONTEXT},
    "sens_m512": {**DEFAULT, "reconstruct_steps": 0, "measure_tokens": 512},
    "sens_floor": {**DEFAULT, "reconstruct_steps": 0, "size_factors": (0.75, 1.0, 1.25, 1.5, 2.0)},
    "default_context": {**DEFAULT, **CONTEXT},
    "default_l1024": {**DEFAULT, "rope_context": 1024},
    "calib_1024_context": {**DEFAULT, "rank_allocation": "uniform", "calib_len": 1024, "calib_samples": 8, **CONTEXT},
    "attention_kl": {**DEFAULT, "reconstruct_attention_kl": 1.0},
    "attention_kl_uniform": {**DEFAULT, "rank_allocation": "uniform", "reconstruct_attention_kl": 1.0},
    "recipe_attention_kl": {**DEFAULT, "rank_allocation": "uniform", "calib_len": 1024, "calib_samples": 8, **CONTEXT,
                            "reconstruct_attention_kl": 1.0},
    "calib_1024_context_sens": {**DEFAULT, "calib_len": 1024, "calib_samples": 8, **CONTEXT},
}
HELD_IN_BINS = (256, 512, 1024)


@torch.no_grad()
def position_kl(model, source, windows: torch.Tensor, bins: tuple[int, ...] = HELD_IN_BINS) -> dict[str, float]:
    """Mean KL(source || model) per token in position bins: < bins[0], bins[0]..bins[1]-1, ..., >= bins[-1]."""
    kls = []
    for w in windows:
        p = source(w[None]).logits[0].log_softmax(-1)
        q = model(w[None]).logits[0].log_softmax(-1)
        kls.append((p.exp() * (p - q)).sum(-1))
    kl = torch.stack(kls)  # [n, T]
    edges = (0, *[b for b in bins if b < kl.shape[1]], kl.shape[1])
    out = {f"{lo}-{hi - 1}": float(kl[:, lo:hi].mean()) for lo, hi in zip(edges, edges[1:])}
    return {**out, "all": float(kl.mean())}


def cached_samples(folder: Path, sample):
    """teacher_windows with a safetensors cache in `folder`, keyed by the prompt windows, the length and the seed."""
    from safetensors.torch import load_file, save_file

    def cached(teacher, text_windows: torch.Tensor, seed: int = 0, progress: bool = True) -> torch.Tensor:
        digest = hashlib.sha256(text_windows.numpy().tobytes()).hexdigest()[:16]
        n, length = text_windows.shape
        path = folder / f"teacher_{n}x{length}_s{seed}_{digest}.safetensors"
        if path.exists():
            return load_file(path)["windows"]
        windows = sample(teacher, text_windows, seed=seed, progress=progress)
        save_file({"windows": windows.contiguous()}, str(path) + ".part")
        Path(str(path) + ".part").rename(path)
        return windows

    return cached


def converted(source_name: str, source, lever: str, kv_budget: float, keep: Path | None):
    """The lever's conversion (kept in keep/<lever> and reused when present), and its report."""
    folder = keep / lever if keep is not None else Path(tempfile.mkdtemp()) / lever
    if not (folder / "conversion_report.json").exists():
        options = dict(LEVERS[lever])
        if options.get("rope_context") == "source":
            options["rope_context"] = source.config.max_position_embeddings
        measure_tokens = options.pop("measure_tokens", budgets.MEASURE_TOKENS)
        size_factors = options.pop("size_factors", budgets.SIZE_FACTORS)
        original_tokens, original_sizes = budgets.MEASURE_TOKENS, budgets.SIZE_FACTORS
        budgets.MEASURE_TOKENS, budgets.SIZE_FACTORS = measure_tokens, size_factors
        plan_stage.MEASURE_TOKENS = measure_tokens  # imported by name there
        try:
            convert(source_name, folder, to="mla", kv_budget=kv_budget, overwrite=True, **options)
        finally:
            budgets.MEASURE_TOKENS, budgets.SIZE_FACTORS = original_tokens, original_sizes
            plan_stage.MEASURE_TOKENS = original_tokens
    report = json.loads((folder / "conversion_report.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    if keep is None:
        shutil.rmtree(folder.parent, ignore_errors=True)
    return model, report


def plot(rows: list[dict], png: str) -> None:
    """One panel per task: the accuracy retained (conversion / source) against distance, one line per lever."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in rows[0]["retrieval"]["accuracy"]]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, row in enumerate(rows):
            if task not in row.get("retained", {}):  # the source, or a lever measured on other tasks
                continue
            points = sorted((int(d), v) for d, v in row["retained"][task].items() if v is not None)
            ax.plot([d for d, _ in points], [v for _, v in points], marker="o", label=row["lever"],
                    color=plt.get_cmap("tab20")(i % 20))  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.15)
        ax.axhline(0.95, color="grey", lw=0.8, ls="--")
        ax.set(title=f"{task}: retained (conversion / source)", xlabel="distance (tokens)", ylabel="retained")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines() if not h.get_label().startswith("_")}
    fig.legend(handles.values(), handles.keys(), fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--kv-budget", type=float, default=0.5)
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--smallest", type=int, default=64, help="shortest retrieval distance (default 64)")
    parser.add_argument("--tasks", default="passkey,copy", help="retrieval tasks (comma-separated)")
    parser.add_argument("--largest", type=int, default=1024)
    parser.add_argument("--levers", default=",".join(LEVERS))
    parser.add_argument("--keep", help="folder: converted models kept in KEEP/<lever> and reused when present")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).with_name("bench_retrieval_levers.json")))
    parser.add_argument("--held-in-len", type=int, default=2048, help="tokens per held-in sample (default 2048)")
    parser.add_argument("--held-in-only", action="store_true",
                        help="only (re)measure the held-in KL of the models kept in --keep, into --out's rows")
    parser.add_argument("--plot", help="only draw --out's rows to this PNG (retained accuracy per distance) and exit")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(Path(args.out).read_text()), args.plot)
        return
    unknown = [lever for lever in args.levers.split(",") if lever not in LEVERS]
    if unknown:
        parser.error(f"--levers: {unknown} not in {list(LEVERS)}")
    if args.held_in_only and not args.keep:
        parser.error("--held-in-only measures the models kept in --keep DIR: give --keep")
    torch.set_num_threads(args.threads)
    source, tokenizer = load_source(args.source)
    text = read_calibration_text(None)
    samples = cached_samples(Path(args.out).parent, teacher_windows)
    windows_stage.teacher_windows = samples  # the conversions' teacher calibration samples, cached the same way
    first = -(-CALIBRATED_TOKENS // args.held_in_len)  # the first window after the tokens every lever calibrates on
    held = samples(source, calibration_windows(text, tokenizer, first + 4, args.held_in_len)[first:], seed=1,
                   progress=False)  # fmt: skip
    if args.held_in_only:  # the held-in KL of models kept in --keep, written into their rows
        rows = json.loads(Path(args.out).read_text())
        for row in rows:
            folder = Path(args.keep) / row["lever"]
            if row["lever"] in args.levers.split(",") and (folder / "config.json").exists():
                model = AutoModelForCausalLM.from_pretrained(folder).eval()
                row["held_in_kl"] = position_kl(model, source, held)
                print(row["lever"], {k: round(v, 4) for k, v in row["held_in_kl"].items()}, flush=True)
                Path(args.out).write_text(json.dumps(rows, indent=1))
        return
    vocab = known_vocabulary(source, tokenizer)
    probe = dict(items=args.items, largest=args.largest, smallest=args.smallest, vocab=vocab,
                 tasks=tuple(args.tasks.split(",")))  # fmt: skip
    out = Path(args.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    key = {"items": args.items, "tasks": args.tasks, "smallest": args.smallest, "largest": args.largest}
    rows = [r for r in rows if r.get("probe") == key]  # rows of other probe settings are dropped
    base_row = next((r for r in rows if r["lever"] == "source"), None)
    if base_row is None:
        base = evaluate_retrieval(source, tokenizer, **probe)
        rows.append({"lever": "source", "probe": key, "retrieval": base.to_dict()})
        out.write_text(json.dumps(rows, indent=1))
    else:  # the source's figures, as computed by an earlier run with the same probes
        base = RetrievalResult.from_dict(base_row["retrieval"])
    print("source", {t: list(a.values()) for t, a in base.accuracy.items()}, flush=True)
    keep = Path(args.keep) if args.keep else None
    for lever in args.levers.split(","):
        started = time.perf_counter()
        model, report = converted(args.source, source, lever, args.kv_budget, keep)
        kl = position_kl(model, source, held)
        result = evaluate_retrieval(model, tokenizer, **probe)
        keep_share = retained(result, base)
        layerwise = report.get("layerwise", {})
        rows = [r for r in (json.loads(out.read_text()) if out.exists() else rows) if r["lever"] != lever]
        rows.append({"lever": lever, "probe": key, "options": LEVERS[lever], "held_in_kl": kl,
                     "conversion_wall_s": report.get("wall_time_s"),
                     "reconstruction_error": [layerwise.get("mean_closed_form_error"), layerwise.get("mean_error")],
                     "budgets": [(b["rope_dim"], b["kv_lora_rank"]) for b in report.get("budgets", {}).get("layers", [])],
                     "retrieval": result.to_dict(),
                     "retained": {t: {str(d): v for d, v in r.items()} for t, r in keep_share.items()}})  # fmt: skip
        print(lever, "held-in KL", {k: round(v, 4) for k, v in kl.items()}, result.to_dict(),
              f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
        out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
