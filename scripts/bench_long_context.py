"""Long-context quality of a source and its conversions: retrieval probes to the source's context and the held-in
long-context criterion, one model per run (runs can go in parallel), one rows file per model.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_long_context.py --model source
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_long_context.py --model "MLA 50%=/tmp/convs/mla50" \
        [--items 4] [--passkey 1024,2048,4096] [--copy 1024,2048] [--gaps 200,1000,3000] [--held-in 2x2048] \
        [--repeat 256,512,1024,2048,4096] [--repeat-items 4] [--repeat-data text|teacher]
        [--parts held_in,retrieval_kl,passkey,copy,passage] [--rows scripts/bench_long_context]
    .venv/bin/python scripts/bench_long_context.py --plot      # table + curves from the rows

Per model (rows/<label>.json, rewritten after each part, so a stopped run keeps what it measured):
    held_in   evaluation/held_in.py: KL(source || model) per token on N teacher samples of L tokens (the source's own
              continuations, seed 1, of 4-token prompts cut from the calibration corpus after the first 8,192 tokens
              every conversion calibrates on); short (< 256) and long (>= 1,024) positions apart. Settings are chosen
              on this, never on the probes below.
    retrieval_kl  evaluation/held_in.py repeat_kl: KL(source || model) on the second copy of S + F + S, S 64
              held-in tokens, F the text after S, the second copy starting D tokens after the first (--repeat);
              --repeat-items per D, seed 0. Held-in text (--repeat-data): `text`, the calibration corpus after the
              first 8,192 tokens and before the last 60,000 characters the passage probe reads; `teacher`, the
              held_in part's samples (D + 64 <= L). Settings are chosen on held_in + retrieval_kl together.
    passkey / copy   evaluation/retrieval.py at the given distances (copy: an item is 2 x distance long), the
              source's vocabulary (known_vocabulary, seed 0), seed 0: every model answers the same items
    perplexity  WikiText-2 test perplexity (6 windows of 512 tokens, ../shared, first 200,000 characters) of the model
              and of the source in the same run, their ratio, and the mean KL(source || model) there
    passage   evaluation/passage.py: a 128-token passage, D tokens of the text that follows it, the passage again;
              texts: WikiText-2 test (../shared, first 200,000 characters) and the last 60,000 characters of the
              package's TinyStories sample (the default calibration reads its first 8,192 tokens only)
--items per cell: a binary score at 0.5 over 4 items is +-0.25 (one standard error); copy and passage average
127..2,048 tokens per item, which narrows it, but items differ more than tokens do.
Teacher samples and the vocabulary are cached in --cache (safetensors).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.evaluation.held_in import (long_context_kl, repeat_items, repeat_kl, repeat_source_log_probs,
                                              repeat_summary, source_log_probs)
from hf_attn_patch.evaluation.passage import evaluate_passages
from hf_attn_patch.evaluation.perplexity import evaluate, windows_of
from hf_attn_patch.evaluation.retrieval import RetrievalResult, known_vocabulary, make_batch, score
from hf_attn_patch.models.pretrained import load_source

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CALIBRATED_TOKENS = 8192  # the calibration windows of every conversion measured here lie within these
REPEAT_SEGMENT = 64  # tokens of the repeated segment of the retrieval_kl part
PROBE_CHARS = 60_000  # the end of the calibration corpus: the passage probe's "tinystories" text, never held-in
PARTS = ("held_in", "retrieval_kl", "passkey", "copy", "passage", "perplexity")
PERPLEXITY_WINDOWS = (6, 512)  # WikiText-2 test windows x tokens (the conversion baselines' protocol, RESEARCH)


def cached(path: Path, make) -> torch.Tensor:
    """make() -> tensor, stored at path (safetensors) and read from there the next time."""
    from safetensors.torch import load_file, save_file

    if path.exists():
        return load_file(path)["t"]
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"t": value.contiguous()}, str(path) + ".part")
    Path(str(path) + ".part").rename(path)
    return value


def evaluation_texts() -> dict[str, str]:
    wiki = (SHARED / "corpora" / "wikitext2_test.txt").read_text()[:200_000]
    return {"wikitext": wiki, "tinystories": read_calibration_text(None)[-PROBE_CHARS:]}


def held_in_samples(args, source, tokenizer, cache: Path) -> torch.Tensor:
    """[N, L] teacher samples of the held_in part (--held-in NxL), drawn once and cached."""
    n, length = (int(x) for x in args.held_in.split("x"))
    first = math.ceil(CALIBRATED_TOKENS / length)
    prompts = calibration_windows(read_calibration_text(None), tokenizer, first + n, length)[first:]
    return cached(cache / f"held_in_{n}x{length}.safetensors",
                  lambda: teacher_windows(source, prompts, seed=1, progress=False))  # fmt: skip


def held_in_text(tokenizer) -> torch.Tensor:
    """Token ids [T] of the calibration corpus after the CALIBRATED_TOKENS every conversion calibrates on and before
    the PROBE_CHARS the passage probe reads."""
    text = read_calibration_text(None)[:-PROBE_CHARS]
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0][CALIBRATED_TOKENS:]


def retrieval_kl(args, model, source, tokenizer, cache: Path, compare: bool) -> dict:
    """repeat_kl at each --repeat distance, one distance at a time (its items do not depend on the others): the
    source's log-probabilities on the scored tokens cached per distance ([items, 63, vocab] fp32), the model's KL
    when `compare` (a converted model; the source's run only fills the cache)."""
    held = held_in_text(tokenizer) if args.repeat_data == "text" else held_in_samples(args, source, tokenizer, cache)
    data = "text" if args.repeat_data == "text" else f"teacher{args.held_in}"
    kl, seconds = {}, {}
    for d in (int(x) for x in args.repeat.split(",")):
        started = time.perf_counter()
        items = repeat_items(held, (d,), args.repeat_items, REPEAT_SEGMENT, seed=0)
        name = f"repeat_{data}_{args.repeat_items}x{REPEAT_SEGMENT}_D{d}_source_logp.safetensors"
        reference = cached(cache / name, lambda: repeat_source_log_probs(source, items))
        if compare:
            kl[d] = repeat_kl(model, reference, items)[f"repeat:{d}"]
        seconds[d] = round(time.perf_counter() - started, 1)
        print(f"  retrieval_kl D={d}: {kl.get(d, float('nan')):.4f} ({seconds[d]:.0f} s)", flush=True)
    return {"data": args.repeat_data, "items": args.repeat_items, "segment": REPEAT_SEGMENT, "seconds": seconds,
            **(repeat_summary(kl) if compare else {})}  # fmt: skip


def probe(model, tokenizer, vocab, task: str, dists: list[int], items: int) -> RetrievalResult:
    """evaluate_retrieval's items (same seeds: task index 0 passkey, 1 copy) at the given distances only."""
    index = {"passkey": 0, "copy": 1}[task]
    accuracy = {}
    for d in dists:
        gen = torch.Generator().manual_seed(index * 100_003 + d)
        started = time.perf_counter()
        accuracy[d] = score(model, make_batch(task, tokenizer, vocab, d, items, gen))
        print(f"  {task} {d}: {accuracy[d]:.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    return RetrievalResult({task: accuracy}, items, model.config.max_position_embeddings)


def measure(args, label: str, folder: str | None) -> None:
    from transformers import AutoModelForCausalLM

    source, tokenizer = load_source(args.source)
    model = source if folder is None else AutoModelForCausalLM.from_pretrained(folder).eval()
    rows = Path(args.rows)
    path = rows / f"{label.lower().replace('%', '').replace(' ', '_').replace('=', '_')}.json"
    row = json.loads(path.read_text()) if path.exists() else {"model": label, "folder": folder}
    row["items"] = args.items
    cache = Path(args.cache) / Path(args.source).name
    for part in args.parts.split(","):
        started = time.perf_counter()
        if part == "held_in":  # the source's run draws the samples (cached) for its conversions' runs
            held = held_in_samples(args, source, tokenizer, cache)
            if folder is not None:  # the source's log-probabilities: computed once, cached (n x L x vocab fp32)
                n, length = (int(x) for x in args.held_in.split("x"))
                reference = cached(cache / f"held_in_{n}x{length}_source_logp.safetensors",
                                   lambda: source_log_probs(source, held))  # fmt: skip
                row["held_in_kl"] = {"samples": args.held_in, **long_context_kl(model, reference, held)}
        elif part == "retrieval_kl":  # the source's run fills the cache of its log-probabilities
            result = retrieval_kl(args, model, source, tokenizer, cache, compare=folder is not None)
            if folder is not None:
                before = row.get("retrieval_kl", {})
                if all(before.get(k) == result[k] for k in ("data", "items", "segment")):  # distances measured before stay
                    kl = {**repeat_curve(row), **repeat_curve({"retrieval_kl": result})}
                    result = {**result, "seconds": {**before["seconds"], **result["seconds"]},
                              **repeat_summary(dict(sorted(kl.items())))}  # fmt: skip
                row["retrieval_kl"] = result
        elif part in ("passkey", "copy"):
            vocab = cached(cache / "vocab.safetensors", lambda: known_vocabulary(source, tokenizer))
            dists = [int(d) for d in getattr(args, part).split(",")]
            row.setdefault("retrieval", {})[part] = probe(model, tokenizer, vocab, part, dists, args.items).to_dict()
        elif part == "passage":
            gaps = tuple(int(g) for g in args.gaps.split(","))
            texts = {name: text for name, text in evaluation_texts().items() if name in args.texts.split(",")}
            result = evaluate_passages(model, tokenizer, texts, gaps, args.items).to_dict()
            if "passage" in row:  # other texts measured before stay
                result["accuracy"] = {**row["passage"]["accuracy"], **result["accuracy"]}
            row["passage"] = result
        elif part == "perplexity":
            n, length = PERPLEXITY_WINDOWS
            windows = windows_of(evaluation_texts()["wikitext"], tokenizer, length, n * length)
            ours = evaluate(model, windows, None if folder is None else source, progress=False)
            base = ours if folder is None else evaluate(source, windows, progress=False)
            row["perplexity"] = {"windows": f"{n}x{length}", "model": ours.perplexity, "source": base.perplexity,
                                 "ratio": ours.perplexity / base.perplexity, "kl": ours.kl_to_reference}  # fmt: skip
        row.setdefault("seconds", {})[part] = round(time.perf_counter() - started, 1)
        shown = ("held_in_kl", "retrieval_kl", "retrieval", "passage", "perplexity")
        print(label, part, json.dumps({k: row.get(k) for k in shown}), flush=True)
        rows.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row, indent=1))


def curves(row: dict) -> dict[str, dict[int, float]]:
    """task -> distance -> accuracy, over the row's probes (passage gaps as given)."""
    out = {}
    for result in [*row.get("retrieval", {}).values(), *([row["passage"]] if "passage" in row else [])]:
        out.update({t: {int(d): a for d, a in acc.items()} for t, acc in result["accuracy"].items()})
    return out


def repeat_curve(row: dict) -> dict[int, float]:
    """distance -> the row's held-in retrieval KL (retrieval_kl part)."""
    return {int(k.split(":")[1]): v for k, v in row.get("retrieval_kl", {}).items() if k.startswith("repeat:")}


def report(rows_dir: Path) -> None:
    """A markdown table (accuracy and retained per task and distance; held-in KL) and rows_dir.png."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(p.read_text()) for p in sorted(rows_dir.glob("*.json"))]
    rows.sort(key=lambda r: (r["model"] != "source", r["model"]))
    base = curves(rows[0]) if rows and rows[0]["model"] == "source" else {}
    tasks = sorted({t for r in rows for t in curves(r)})
    dists = sorted({d for r in rows for d in repeat_curve(r)})
    header = ["model", "ppl (x source)", "held-in KL short / long / all",
              f"held-in retrieval KL D {' / '.join(map(str, dists))} / long", *tasks]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        kl = r.get("held_in_kl")
        kls = f"{kl['short']:.3f} / {kl.get('long', float('nan')):.3f} / {kl['all']:.3f}" if kl else "-"
        rk = r.get("retrieval_kl", {})
        rks = " / ".join(f"{repeat_curve(r)[d]:.3f}" if d in repeat_curve(r) else "-" for d in dists)
        rks = f"{rks} / {rk['repeat_long']:.3f}" if "repeat_long" in rk else (f"{rks} / -" if repeat_curve(r) else "-")
        cells = []
        for t in tasks:
            acc = curves(r).get(t, {})
            cells.append(" ".join(f"{a:.2f}" + (f" ({a / base[t][d]:.0%})" if r is not rows[0] and base.get(t, {}).get(d)
                                                 else "") for d, a in sorted(acc.items())) or "-")  # fmt: skip
        ppl = r.get("perplexity")
        ppls = f"{ppl['model']:.2f} ({ppl['ratio']:.2f}x)" if ppl else "-"
        print("| " + " | ".join([r["model"], ppls, kls, rks, *cells]) + " |")
    fig, axes = plt.subplots(1, len(tasks) + 2, figsize=(4.2 * (len(tasks) + 2), 3.6), squeeze=False)
    colours = {r["model"]: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(rows)}
    for ax, t in zip(axes[0], tasks):
        for r in rows:
            points = sorted(curves(r).get(t, {}).items())
            if points:
                ax.plot(*zip(*points), marker="o", label=r["model"], color=colours[r["model"]],
                        ls="--" if r["model"] == "source" else "-")  # fmt: skip
        ax.set(xscale="log", title=t, xlabel="distance (tokens; passage: D)", ylabel="accuracy", ylim=(-0.02, 1.02))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, alpha=0.3)
    ax = axes[0][-2]  # the held-in criterion by position bin
    for r in rows:
        bins = [(k, v) for k, v in r.get("held_in_kl", {}).items() if "-" in k]
        if bins:
            ax.plot([int(k.split("-")[0]) for k, _ in bins], [v for _, v in bins], marker="s", color=colours[r["model"]])
    ax.set(title="held-in KL by position", xlabel="position bin start", ylabel="KL(source || model)")
    ax.grid(True, alpha=0.3)
    ax = axes[0][-1]  # the held-in retrieval criterion by distance
    for r in rows:
        points = sorted(repeat_curve(r).items())
        if points:
            ax.plot(*zip(*points), marker="s", color=colours[r["model"]], label=r["model"])
    ax.set(xscale="log", title="held-in retrieval KL", xlabel="distance D", ylabel="KL on the second copy")
    ax.grid(True, alpha=0.3)
    handles = {h.get_label(): h for a in axes[0] for h in a.get_lines() if not h.get_label().startswith("_")}
    if handles:
        fig.legend(handles.values(), handles.keys(), fontsize=7, loc="lower center", ncol=len(handles))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(rows_dir.with_suffix(".png"), dpi=100)
    print(f"plot: {rows_dir.with_suffix('.png')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--model", default="source", help="'source', or LABEL=FOLDER of a converted model")
    parser.add_argument("--items", type=int, default=4, help="items per probe cell (default 4)")
    parser.add_argument("--passkey", default="1024,2048,4096", help="passkey distances")
    parser.add_argument("--copy", default="1024,2048", help="copy distances (an item is 2 x distance long)")
    parser.add_argument("--gaps", default="200,1000,3000", help="repeated-passage gaps D")
    parser.add_argument("--texts", default="wikitext,tinystories", help="repeated-passage texts")
    parser.add_argument("--held-in", default="2x2048", help="NxL teacher samples of the held-in criterion")
    parser.add_argument("--repeat", default="256,512,1024,2048,4096", help="retrieval_kl distances D")
    parser.add_argument("--repeat-items", type=int, default=4, help="retrieval_kl items per distance (default 4)")
    parser.add_argument("--repeat-data", choices=("text", "teacher"), default="text",
                        help="retrieval_kl held-in text: the calibration corpus, or the held_in part's samples")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"of {PARTS}")
    parser.add_argument("--rows", default=str(ROOT / "scripts" / "bench_long_context"))
    parser.add_argument("--cache", default="/tmp/hfap-long-context", help="teacher samples and vocabulary cache")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", action="store_true", help="only print the table and draw the curves")
    args = parser.parse_args()
    if args.plot:
        report(Path(args.rows))
        return
    unknown = [p for p in args.parts.split(",") if p not in PARTS]
    if unknown:
        parser.error(f"--parts: {unknown} not in {PARTS}")
    try:
        repeat = [int(d) for d in args.repeat.split(",")]
    except ValueError:
        parser.error(f"--repeat {args.repeat!r}: comma-separated distances expected")
    if "retrieval_kl" in args.parts.split(",") and args.repeat_data == "teacher":
        length = int(args.held_in.split("x")[1])
        if max(repeat) + REPEAT_SEGMENT > length:
            parser.error(f"--repeat {args.repeat}: D + {REPEAT_SEGMENT} must fit the --held-in samples of {length} "
                         "tokens with --repeat-data teacher")  # fmt: skip
    label, _, folder = args.model.partition("=")
    if label != "source" and not (Path(folder) / "config.json").exists():
        parser.error(f"--model {args.model!r}: expected 'source' or LABEL=FOLDER of a saved model")
    torch.set_num_threads(args.threads)
    measure(args, label, folder or None)


if __name__ == "__main__":
    main()
