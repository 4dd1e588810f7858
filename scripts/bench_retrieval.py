"""Context retrieval, zero-shot accuracy and perplexity of a source and its conversions, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_retrieval.py --source smollm2 --work /tmp/convs \
        [--targets "MLA 50%,MLA 50% deepseek_v3,MQA,MLA 25%"] [--items 8] [--largest 1024] [--limit 200] \
        [--eval-data $DATA/evals] [--out scripts/bench_retrieval_smollm2.png]

Each target is converted with the CLI's defaults (`hf-attn convert SRC OUT --to ...`: teacher calibration,
reconstruction "auto", sensitivity rank allocation for native MLA), into --work/<slug> unless that folder exists
(then it is reused: its conversion_report.json is read for the KV bytes). Per model:
    perplexity   on text never calibrated on: WikiText-2 test (first 200,000 characters, 4 x 512 tokens) for
                 SmolLM2, the last 60,000 characters of the package's TinyStories sample (8 x 256) otherwise;
                 ratio to the source's
    retrieval    evaluation/retrieval.py: passkey / copy / induction accuracy per distance (up to --largest, else
                 the source's context), --items per (task, distance), the source's vocabulary and seed 0 for all
    accuracy     lm-eval zero-shot, the offline tasks (zero_shot_offline) on their first --limit items each;
                 average of acc_norm (winogrande: acc); retained = average / the source's
Writes <out>.json (rows, after each model) and <out> (PNG: distance -> accuracy per task, one line per model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.io.calibration import read_calibration_text
from hf_attn_patch.models.pretrained import load_source
from hf_attn_patch.evaluation.perplexity import evaluate, windows_of
from hf_attn_patch.evaluation.retrieval import RetrievalResult, evaluate_retrieval, known_vocabulary, retained, table

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TARGETS = {
    "GQA 3": ["--to", "gqa", "--kv-heads", "3"],
    "GQA 2": ["--to", "gqa", "--kv-heads", "2"],
    "MQA": ["--to", "mqa"],
    "MLA 50%": ["--to", "mla", "--kv-budget", "0.5"],
    "MLA 50% deepseek_v3": ["--to", "mla", "--kv-budget", "0.5", "--format", "deepseek_v3"],
    "MLA 25%": ["--to", "mla", "--kv-budget", "0.25"],
    "MLA 25% deepseek_v3": ["--to", "mla", "--kv-budget", "0.25", "--format", "deepseek_v3"],
}


def slug(label: str) -> str:
    return label.lower().replace("%", "").replace(" ", "_")


def eval_windows(source: str, tokenizer) -> torch.Tensor:
    if source == "smollm2":
        wiki = (SHARED / "corpora" / "wikitext2_test.txt").read_text()[:200_000]
        return windows_of(wiki, tokenizer, 512, 2048)
    return windows_of(read_calibration_text(None)[-60_000:], tokenizer, 256, 2048)


def accuracy(model, tokenizer, limit: int) -> dict:
    from hf_attn_patch.evaluation.harness import OFFLINE_TAG, average_accuracy, run_tasks, task_manager

    scores = run_tasks(model, tokenizer, [OFFLINE_TAG], task_manager(), limit=limit, batch_size=8)
    return {"average": average_accuracy(scores), "tasks": {f"{s.task} {s.metric}": s.value for s in scores}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2", help="'smollm2', 'default' or a model folder")
    parser.add_argument("--work", required=True, help="folder of the conversions (reused when present)")
    parser.add_argument("--targets", default="MLA 50%,MLA 50% deepseek_v3,MQA,MLA 25%",
                        help="comma-separated, of " + str(list(TARGETS)).replace("%", "%%"))  # argparse formats help with %
    parser.add_argument("--items", type=int, default=8, help="retrieval items per task and distance")
    parser.add_argument("--smallest", type=int, default=16, help="shortest retrieval distance (default 16)")
    parser.add_argument("--tasks", default="passkey,copy,induction", help="retrieval tasks (comma-separated)")
    parser.add_argument("--largest", type=int, help="longest retrieval distance (default: the source's context)")
    parser.add_argument("--limit", type=int, default=200, help="lm-eval items per task (0: no lm-eval)")
    parser.add_argument("--eval-data", default=str(SHARED / "evals"), help="folder of the offline tasks' files")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--source-row", help="a rows JSON of an earlier run with the same settings: its source row is "
                        "reused instead of measuring the source again")
    parser.add_argument("--out", default=str(ROOT / "scripts" / "bench_retrieval.png"))
    args = parser.parse_args()
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        if t not in TARGETS:
            raise SystemExit(f"--targets: {t!r} is not one of {list(TARGETS)}")
    source_row = None
    if args.source_row:  # the source's row from an earlier run with the same settings, checked before any work
        source_row = json.loads(Path(args.source_row).read_text())[0]
        if source_row["model"] != "source" or source_row["retrieval"]["items"] != args.items:
            parser.error(f"--source-row {args.source_row}: its first row is {source_row['model']!r} with "
                         f"{source_row['retrieval']['items']} items, not the source's with --items {args.items}")
    torch.set_num_threads(args.threads)
    os.environ["HF_ATTN_EVAL_DATA"] = str(Path(args.eval_data).resolve())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows_file = Path(args.out).with_suffix(".json")
    source, tokenizer = load_source(args.source)
    windows = eval_windows(args.source, tokenizer)
    vocab = known_vocabulary(source, tokenizer)
    rows, results = [], {}

    def measure(label, model, kv, report):
        started = time.perf_counter()
        ppl = evaluate(model, windows, progress=False).perplexity
        ret = evaluate_retrieval(model, tokenizer, items=args.items, largest=args.largest, smallest=args.smallest,
                                 vocab=vocab, tasks=tuple(args.tasks.split(",")))  # fmt: skip
        acc = accuracy(model, tokenizer, args.limit) if args.limit else None
        results[label] = ret
        row = dict(model=label, kv_bytes=kv, ppl=ppl, retrieval=ret.to_dict(), accuracy=acc, report=report,
                   seconds=round(time.perf_counter() - started, 1), commit=commit)  # fmt: skip
        if rows:
            base = rows[0]
            row["ppl_ratio"] = ppl / base["ppl"]
            row["retrieval_retained"] = {t: {str(d): v for d, v in r.items()} for t, r in retained(ret, results[base["model"]]).items()}
            if acc:
                row["accuracy_retained"] = acc["average"] / base["accuracy"]["average"]
        rows.append(row)
        rows_file.write_text(json.dumps(rows, indent=1))
        print(f"{label}: ppl {ppl:.3f}" + (f" (x{row['ppl_ratio']:.3f})" if "ppl_ratio" in row else "")
              + (f", accuracy {acc['average']:.4f}" if acc else "") + f", retrieval mean {ret.mean():.3f}"
              + f" [{row['seconds']:.0f} s]", flush=True)  # fmt: skip

    from hf_attn_patch.kv_memory import kv_cache_bytes

    if source_row is not None:
        results["source"] = RetrievalResult.from_dict(source_row["retrieval"])
        rows.append(source_row)
    else:
        measure("source", source, kv_cache_bytes(source.config, 1), None)
    from transformers import AutoModelForCausalLM

    for label in targets:
        out = Path(args.work) / slug(label)
        if not out.exists():
            cmd = [str(ROOT / ".venv" / "bin" / "hf-attn"), "convert", args.source, str(out), *TARGETS[label]]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        report = json.loads((out / "conversion_report.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        measure(label, model, report["kv_bytes_per_token_fp16"]["after"], {k: report.get(k) for k in ("format", "options")})
        del model
    print("\n" + table(results))
    if any(r["accuracy"] for r in rows):
        print("\n| model | KV B/token | ppl ratio | average accuracy | retained | retrieval mean | retrieval min retained |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            worst = min((v for t in r.get("retrieval_retained", {}).values() for v in t.values() if v is not None), default=1.0)
            acc = r["accuracy"]["average"] if r["accuracy"] else float("nan")
            print(f"| {r['model']} | {r['kv_bytes']} | {r.get('ppl_ratio', 1.0):.3f} | {acc:.4f} | "
                  f"{r.get('accuracy_retained', 1.0):.3f} | {r['retrieval']['mean']:.3f} | {worst:.2f} |")  # fmt: skip
    plot(results, args.out, args.source)


def plot(results: dict[str, RetrievalResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(next(iter(results.values())).accuracy)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for label, r in results.items():
            pts = sorted(r.accuracy[task].items())
            ax.plot(*zip(*pts), marker="o", label=label, linestyle="--" if label == "source" else "-")
        ax.set(xscale="log", xlabel="distance (tokens)", ylabel="accuracy", title=f"{title}: {task}", ylim=(-0.02, 1.02))
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
