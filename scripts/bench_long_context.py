"""Long context: what a conversion keeps of the source's retrieval and long-context quality, and what heals it.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_long_context.py PART [options]     # PART --help: its options

Parts (rows under scripts/results/long_context/ unless the part's --out / --rows says otherwise):
    probe             one model (the source, or LABEL=FOLDER of a conversion) on the long-context probes and the
                      held-in criteria, one rows file per model; --plot draws the table and the curves
    heal              long-window healing of a converted folder (text, teacher or retrieval windows), saved for probe
    levers            one MLA long-context lever converted into --keep/<lever>, then measured with probe
    retrieval         several targets converted with the CLI's defaults: retrieval, zero-shot accuracy, perplexity
    heads             each source head's copy score on a repeated segment, beside a conversion's per-layer ranks
    retrieval-levers  an MLA conversion's stages added one at a time and candidate fixes, on held-in KL and probes
    latent-kv         latent K/V closed-form settings built in memory and scored on the held-in criteria
    text              the whole `--context long` conversion once per calibration and healing text, each probed on
                      held-out text of two domains beside the source (which text should a conversion read?)
    step-cost         seconds per retrieval healing step with the LM head at every position or only where weighed

Every part loads the source by name (--source, default smollm2). Held-in text (what settings are chosen on) is the
package's TinyStories sample after the CALIBRATED_TOKENS every conversion calibrates on and before the PROBE_CHARS
the passage probe reads; WikiText-2 test and the offline tasks are never trained or chosen on. Teacher samples, the
source's log-probabilities and the vocabulary are cached as safetensors (--cache / --keep), keyed by what makes them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.models.pretrained import load_source

import benchlib

RESULTS = benchlib.RESULTS / "long_context"
CALIBRATED_TOKENS = 8192  # the calibration windows of every conversion measured here lie within these
PROBE_CHARS = 60_000  # the end of the calibration corpus: the passage probe's "tinystories" text, never held-in


def load_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def cached_teacher(folder: Path, sample=teacher_windows):
    """teacher_windows with a safetensors cache in `folder`, keyed by the prompt windows, the length and the seed."""

    def cached(teacher, text_windows: torch.Tensor, seed: int = 0, progress: bool = True) -> torch.Tensor:
        digest = hashlib.sha256(text_windows.numpy().tobytes()).hexdigest()[:16]
        n, length = text_windows.shape
        path = folder / f"teacher_{n}x{length}_s{seed}_{digest}.safetensors"
        return benchlib.cached(path, lambda: sample(teacher, text_windows, seed=seed, progress=progress), "windows")

    return cached


# ---------------------------------------------------------------------------------------------------------- probe
PROBE_PARTS = ("held_in", "retrieval_kl", "passkey", "copy", "passage", "perplexity")
REPEAT_SEGMENT = 64  # tokens of the repeated segment of the retrieval_kl part
PERPLEXITY_WINDOWS = (6, 512)  # WikiText-2 test windows x tokens (the conversion baselines' protocol, RESEARCH)


def evaluation_texts() -> dict[str, str]:
    return {"wikitext": benchlib.wikitext(), "tinystories": read_calibration_text(None)[-PROBE_CHARS:]}


def held_in_samples(args, source, tokenizer, cache: Path) -> torch.Tensor:
    """[N, L] teacher samples of the held_in part (--held-in NxL), drawn once and cached."""
    n, length = (int(x) for x in args.held_in.split("x"))
    first = math.ceil(CALIBRATED_TOKENS / length)
    prompts = calibration_windows(read_calibration_text(None), tokenizer, first + n, length)[first:]
    return benchlib.cached(
        cache / f"held_in_{n}x{length}.safetensors", lambda: teacher_windows(source, prompts, seed=1, progress=False)
    )


def held_in_text(tokenizer) -> torch.Tensor:
    """Token ids [T] of the calibration corpus after the CALIBRATED_TOKENS every conversion calibrates on and before
    the PROBE_CHARS the passage probe reads."""
    text = read_calibration_text(None)[:-PROBE_CHARS]
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0][CALIBRATED_TOKENS:]


def retrieval_kl(args, model, source, tokenizer, cache: Path, compare: bool) -> dict:
    """repeat_kl at each --repeat distance, one distance at a time (its items do not depend on the others): the
    source's log-probabilities on the scored tokens cached per distance ([items, 63, vocab] fp32), the model's KL
    when `compare` (a converted model; the source's run only fills the cache)."""
    from hf_attn_patch.evaluation.held_in import repeat_items, repeat_kl, repeat_source_log_probs, repeat_summary

    held = held_in_text(tokenizer) if args.repeat_data == "text" else held_in_samples(args, source, tokenizer, cache)
    data = "text" if args.repeat_data == "text" else f"teacher{args.held_in}"
    kl, seconds = {}, {}
    for d in (int(x) for x in args.repeat.split(",")):
        started = time.perf_counter()
        items = repeat_items(held, (d,), args.repeat_items, REPEAT_SEGMENT, seed=0)
        name = f"repeat_{data}_{args.repeat_items}x{REPEAT_SEGMENT}_D{d}_source_logp.safetensors"
        reference = benchlib.cached(cache / name, lambda: repeat_source_log_probs(source, items))
        if compare:
            kl[d] = repeat_kl(model, reference, items)[f"repeat:{d}"]
        seconds[d] = round(time.perf_counter() - started, 1)
        print(f"  retrieval_kl D={d}: {kl.get(d, float('nan')):.4f} ({seconds[d]:.0f} s)", flush=True)
    return {
        "data": args.repeat_data,
        "items": args.repeat_items,
        "segment": REPEAT_SEGMENT,
        "seconds": seconds,
        **(repeat_summary(kl) if compare else {}),
    }


def probe_task(model, tokenizer, vocab, task: str, dists: list[int], items: int):
    """evaluate_retrieval's items (same seeds: task index 0 passkey, 1 copy) at the given distances only."""
    from hf_attn_patch.evaluation.retrieval import RetrievalResult, make_batch, score

    index = {"passkey": 0, "copy": 1}[task]
    accuracy = {}
    for d in dists:
        gen = torch.Generator().manual_seed(index * 100_003 + d)
        started = time.perf_counter()
        accuracy[d] = score(model, make_batch(task, tokenizer, vocab, d, items, gen))
        print(f"  {task} {d}: {accuracy[d]:.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    return RetrievalResult({task: accuracy}, items, model.config.max_position_embeddings)


def probe_measure(args, label: str, folder: str | None) -> None:
    from hf_attn_patch.evaluation.held_in import long_context_kl, repeat_summary, source_log_probs
    from hf_attn_patch.evaluation.passage import evaluate_passages
    from hf_attn_patch.evaluation.perplexity import evaluate, windows_of
    from hf_attn_patch.evaluation.retrieval import known_vocabulary

    source, tokenizer = load_source(args.source)
    model = source if folder is None else load_model(folder)
    rows = Path(args.rows)
    path = rows / f"{benchlib.slug(label)}.json"
    row = json.loads(path.read_text()) if path.exists() else {"model": label, "folder": folder}
    row["items"] = args.items
    cache = Path(args.cache) / Path(args.source).name
    for part in args.parts.split(","):
        started = time.perf_counter()
        if part == "held_in":  # the source's run draws the samples (cached) for its conversions' runs
            held = held_in_samples(args, source, tokenizer, cache)
            if folder is not None:  # the source's log-probabilities: computed once, cached (n x L x vocab fp32)
                n, length = (int(x) for x in args.held_in.split("x"))
                reference = benchlib.cached(
                    cache / f"held_in_{n}x{length}_source_logp.safetensors", lambda: source_log_probs(source, held)
                )
                row["held_in_kl"] = {"samples": args.held_in, **long_context_kl(model, reference, held)}
        elif part == "retrieval_kl":  # the source's run fills the cache of its log-probabilities
            result = retrieval_kl(args, model, source, tokenizer, cache, compare=folder is not None)
            if folder is not None:
                before = row.get("retrieval_kl", {})
                if all(
                    before.get(k) == result[k] for k in ("data", "items", "segment")
                ):  # distances measured before stay
                    kl = {**repeat_curve(row), **repeat_curve({"retrieval_kl": result})}
                    result = {
                        **result,
                        "seconds": {**before["seconds"], **result["seconds"]},
                        **repeat_summary(dict(sorted(kl.items()))),
                    }
                row["retrieval_kl"] = result
        elif part in ("passkey", "copy"):
            vocab = benchlib.cached(cache / "vocab.safetensors", lambda: known_vocabulary(source, tokenizer))
            dists = [int(d) for d in getattr(args, part).split(",")]
            result = probe_task(model, tokenizer, vocab, part, dists, args.items)
            row.setdefault("retrieval", {})[part] = result.to_dict()
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
            row["perplexity"] = {
                "windows": f"{n}x{length}",
                "model": ours.perplexity,
                "source": base.perplexity,
                "ratio": ours.perplexity / base.perplexity,
                "kl": ours.kl_to_reference,
            }
        row.setdefault("seconds", {})[part] = round(time.perf_counter() - started, 1)
        shown = ("held_in_kl", "retrieval_kl", "retrieval", "passage", "perplexity")
        print(label, part, json.dumps({k: row.get(k) for k in shown}), flush=True)
        benchlib.write_rows(path, row)


def curves(row: dict) -> dict[str, dict[int, float]]:
    """task -> distance -> accuracy, over the row's probes (passage gaps as given)."""
    out = {}
    for result in [*row.get("retrieval", {}).values(), *([row["passage"]] if "passage" in row else [])]:
        out.update({t: {int(d): a for d, a in acc.items()} for t, acc in result["accuracy"].items()})
    return out


def repeat_curve(row: dict) -> dict[int, float]:
    """distance -> the row's held-in retrieval KL (retrieval_kl part)."""
    return {int(k.split(":")[1]): v for k, v in row.get("retrieval_kl", {}).items() if k.startswith("repeat:")}


def probe_report(rows_dir: Path) -> None:
    """A markdown table (accuracy and retained per task and distance; held-in KL) and rows_dir.png."""
    import matplotlib.ticker

    plt = benchlib.pyplot()
    rows = [json.loads(p.read_text()) for p in sorted(rows_dir.glob("*.json"))]
    rows.sort(key=lambda r: (r["model"] != "source", r["model"]))
    base = curves(rows[0]) if rows and rows[0]["model"] == "source" else {}
    tasks = sorted({t for r in rows for t in curves(r)})
    dists = sorted({d for r in rows for d in repeat_curve(r)})
    header = [
        "model",
        "ppl (x source)",
        "held-in KL short / long / all",
        f"held-in retrieval KL D {' / '.join(map(str, dists))} / long",
        *tasks,
    ]
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
            shown = [
                f"{a:.2f}" + (f" ({a / base[t][d]:.0%})" if r is not rows[0] and base.get(t, {}).get(d) else "")
                for d, a in sorted(acc.items())
            ]
            cells.append(" ".join(shown) or "-")
        ppl = r.get("perplexity")
        ppls = f"{ppl['model']:.2f} ({ppl['ratio']:.2f}x)" if ppl else "-"
        print("| " + " | ".join([r["model"], ppls, kls, rks, *cells]) + " |")
    fig, axes = plt.subplots(1, len(tasks) + 2, figsize=(4.2 * (len(tasks) + 2), 3.6), squeeze=False)
    colours = {r["model"]: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(rows)}
    for ax, t in zip(axes[0], tasks):
        for r in rows:
            points = sorted(curves(r).get(t, {}).items())
            if points:
                style = "--" if r["model"] == "source" else "-"
                ax.plot(*zip(*points), marker="o", label=r["model"], color=colours[r["model"]], ls=style)
        ax.set(xscale="log", title=t, xlabel="distance (tokens; passage: D)", ylabel="accuracy", ylim=(-0.02, 1.02))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, alpha=0.3)
    ax = axes[0][-2]  # the held-in criterion by position bin
    for r in rows:
        bins = [(k, v) for k, v in r.get("held_in_kl", {}).items() if "-" in k]
        if bins:
            ax.plot(
                [int(k.split("-")[0]) for k, _ in bins], [v for _, v in bins], marker="s", color=colours[r["model"]]
            )
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


def probe_options(parser) -> None:
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
    parser.add_argument(
        "--repeat-data",
        choices=("text", "teacher"),
        default="text",
        help="retrieval_kl held-in text: the calibration corpus, or the held_in part's samples",
    )
    parser.add_argument("--parts", default=",".join(PROBE_PARTS), help=f"of {PROBE_PARTS}")
    parser.add_argument("--rows", default=str(RESULTS / "probes"), help="folder of the rows, one file per model")
    parser.add_argument("--cache", default="/tmp/hfap-long-context", help="teacher samples and vocabulary cache")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", action="store_true", help="only print the table and draw the curves")


def probe(args) -> None:
    """One model on the long-context probes and the held-in criteria, its row in --rows/<label>.json.

    Per model (rows/<label>.json, rewritten after each part, so a stopped run keeps what it measured):
        held_in   evaluation/held_in.py: KL(source || model) per token on N teacher samples of L tokens (the source's
                  own continuations, seed 1, of 4-token prompts cut from the calibration corpus after the first
                  8,192 tokens every conversion calibrates on); short (< 256) and long (>= 1,024) positions apart.
                  Settings are chosen on this, never on the probes below.
        retrieval_kl  evaluation/held_in.py repeat_kl: KL(source || model) on the second copy of S + F + S, S 64
                  held-in tokens, F the text after S, the second copy starting D tokens after the first (--repeat);
                  --repeat-items per D, seed 0. Held-in text (--repeat-data): `text`, the calibration corpus after
                  the first 8,192 tokens and before the last 60,000 characters the passage probe reads; `teacher`,
                  the held_in part's samples (D + 64 <= L). Settings are chosen on held_in + retrieval_kl together.
        passkey / copy   evaluation/retrieval.py at the given distances (copy: an item is 2 x distance long), the
                  source's vocabulary (known_vocabulary, seed 0), seed 0: every model answers the same items
        perplexity  WikiText-2 test perplexity (6 windows of 512 tokens, first 200,000 characters) of the model
                  and of the source in the same run, their ratio, and the mean KL(source || model) there
        passage   evaluation/passage.py: a 128-token passage, D tokens of the text that follows it, the passage
                  again; texts: WikiText-2 test (first 200,000 characters) and the last 60,000 characters of the
                  package's TinyStories sample (the default calibration reads its first 8,192 tokens only)
    --items per cell: a binary score at 0.5 over 4 items is +-0.25 (one standard error); copy and passage average
    127..2,048 tokens per item, which narrows it, but items differ more than tokens do. --plot: a markdown table of
    the rows and ROWS.png (the curves).
    """
    if args.plot:
        probe_report(Path(args.rows))
        return
    unknown = [p for p in args.parts.split(",") if p not in PROBE_PARTS]
    if unknown:
        args.parser.error(f"--parts: {unknown} not in {PROBE_PARTS}")
    try:
        repeat = [int(d) for d in args.repeat.split(",")]
    except ValueError:
        args.parser.error(f"--repeat {args.repeat!r}: comma-separated distances expected")
    if "retrieval_kl" in args.parts.split(",") and args.repeat_data == "teacher":
        length = int(args.held_in.split("x")[1])
        if max(repeat) + REPEAT_SEGMENT > length:
            args.parser.error(
                f"--repeat {args.repeat}: D + {REPEAT_SEGMENT} must fit the --held-in samples of {length} "
                "tokens with --repeat-data teacher"
            )
    label, _, folder = args.model.partition("=")
    if label != "source" and not (Path(folder) / "config.json").exists():
        args.parser.error(f"--model {args.model!r}: expected 'source' or LABEL=FOLDER of a saved model")
    torch.set_num_threads(args.threads)
    probe_measure(args, label, folder or None)


# ----------------------------------------------------------------------------------------------------------- heal
def natural_data(args, source, tokenizer) -> dict:
    """text / teacher: steps training windows and the next one held in."""
    windows = calibration_windows(read_calibration_text(None), tokenizer, args.steps + 1, args.length)
    if args.data == "teacher":
        windows = teacher_windows(source, windows, seed=0)
    return dict(windows=windows[:-1], held_in=windows[-1:])


def retrieval_data(args, tokenizer, mix: dict) -> dict:
    """retrieval: weighted windows from the corpus before the probe's text, held in from its last HELD_SHARE."""
    from hf_attn_patch.converters.io.heal_data import retrieval_windows
    from hf_attn_patch.converters.stages.heal import HELD_SHARE

    text = read_calibration_text(None)[:-PROBE_CHARS]
    stream = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    cut = int(len(stream) * (1 - HELD_SHARE))
    count = args.steps * args.batch_size
    train = retrieval_windows(stream[:cut], tokenizer, count, args.length, seed=args.seed, mix=mix)
    held = retrieval_windows(stream[cut:], tokenizer, args.held_in, args.length, seed=args.seed + 1, mix=mix)
    return dict(windows=train.ids, weights=train.weights, held_in=held.ids, held_in_weights=held.weights)


def heal_options(parser) -> None:
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--student", required=True, help="a converted model folder (native format)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", choices=("text", "teacher", "retrieval"), default="text")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", default="1e-4", help="a rate, or auto (the range test)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--held-in", type=int, default=8, help="retrieval: held-in windows")
    parser.add_argument("--mix", default="repeat=2,facts=1,plain=1", help="retrieval: the kinds' shares")
    parser.add_argument("--train", default="attention")
    parser.add_argument("--seed", type=int, default=0, help="retrieval: the windows' seed")


def heal(args) -> None:
    """Long-window healing of a converted folder: distillation from the source on windows of --length tokens, with
    the held-in KL before and after and the wall time; the healed model (and OUT/long_heal.json) saved for probe.

    The same loop as `hf-attn convert ... --heal-steps N --heal-len L --heal-data D --heal-layerwise-steps 0`
    (converters/fitting/heal.py), run on an already converted folder so the conversion is not repeated. Data
    (calibration only; the probes' texts, the offline tasks and WikiText never enter):
        text       windows 0..steps-1 of the package's TinyStories sample cut at --length (its first steps x length
                   tokens); held in: the next window (the best held-in state is returned). The probe part's
                   TinyStories passages come from the sample's last 60,000 characters, far after these.
        teacher    the source's own continuations (seed 0) of 4-token prompts from those windows (costs steps x
                   length decoding steps of sampling first).
        retrieval  windows that ask for retrieval from far back (converters/io/heal_data.py: repeated segments,
                   facts asked again at the end, plain text; --mix), KL weighted on the positions that retrieve:
                   from the corpus without the passage probe's last 60,000 characters, the first 85% of its tokens
                   for training, --held-in windows of the same kinds (another seed) from the rest.
    """
    from hf_attn_patch.converters.fitting.heal import heal as heal_model

    if not (Path(args.student) / "config.json").exists():
        args.parser.error(f"--student {args.student!r} is not a saved model folder")
    try:
        lr = args.lr if args.lr == "auto" else float(args.lr)
        mix = {kind: float(share) for kind, share in (part.split("=") for part in args.mix.split(","))}
    except ValueError:
        args.parser.error(f"--lr {args.lr!r} or --mix {args.mix!r} does not parse")
    torch.set_num_threads(args.threads)
    source, tokenizer = load_source(args.source)
    student = load_model(args.student)
    started = time.perf_counter()
    data = retrieval_data(args, tokenizer, mix) if args.data == "retrieval" else natural_data(args, source, tokenizer)
    prepared = time.perf_counter() - started
    result = heal_model(
        student,
        source,
        data.pop("windows"),
        **data,
        steps=args.steps,
        lr=lr,
        batch_size=args.batch_size,
        train=args.train,
        eval_every=max(1, args.steps // 6),
    )
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    student.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {
        "student": args.student,
        "data": args.data,
        "length": args.length,
        "steps": args.steps,
        "lr": result.lr,
        "batch_size": args.batch_size,
        "train": args.train,
        **({"mix": mix} if args.data == "retrieval" else {}),
        "data_s": round(prepared, 1),
        "heal_s": round(result.seconds, 1),
        "s_per_step": round(result.seconds / max(1, result.steps), 2),
        "tokens": result.tokens,
        "held_in_kl": result.held_in,
        "best_step": result.best_step,
        "improved": result.improved,
        "range_test": result.range_test,
        "losses": result.losses,
    }
    (out / "long_heal.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}), flush=True)


# --------------------------------------------------------------------------------------------------------- levers
MIXED = "2048,1024,512,256,256"  # --calib-lengths: one calibration window packs samples of these lengths
LONG_BASE = {
    "calib_source": "teacher",
    "calib_samples": 32,
    "calib_len": 256,
    "reconstruct_steps": 60,
    "reconstruct_attention_kl": 0.0,
    "rope_context": 256,
}
# the calibration-length lever on the closed form (text windows, uniform ranks, no reconstruction, L = the source's
# context): reconstruction on long windows costs O(T^2) per step, beyond a shared 2-core CPU's hour
LONG_CLOSED = {
    **LONG_BASE,
    "format": "native",
    "rank_allocation": "uniform",
    "calib_source": "text",
    "reconstruct_steps": 0,
    "rope_context": 8192,
}
LONG_LEVERS = {
    "uniform_ds": {**LONG_BASE, "format": "deepseek_v3", "rank_allocation": "uniform"},
    "retrieval": {**LONG_BASE, "format": "native", "rank_allocation": "retrieval"},
    "mixed": {
        **LONG_BASE,
        "format": "native",
        "rank_allocation": "uniform",
        "calib_samples": 2,
        "calib_len": 4096,
        "calib_lengths": MIXED,
        "rope_context": 8192,
    },
    "recipe": {
        **LONG_BASE,
        "format": "native",
        "rank_allocation": "uniform",
        "calib_samples": 8,
        "calib_len": 1024,
        "rope_context": 8192,
    },
    "closed_256": LONG_CLOSED,
    "closed_1024": {**LONG_CLOSED, "calib_samples": 8, "calib_len": 1024},
    "closed_4096": {**LONG_CLOSED, "calib_samples": 2, "calib_len": 4096},
    "closed_mixed": {**LONG_CLOSED, "calib_samples": 2, "calib_len": 4096, "calib_lengths": MIXED},
    # the RoPE lever: decoupled RoPE dims against latent rank (default d_r 64 + d_c 128 per layer)
    "closed_rope32": {**LONG_CLOSED, "rope_dim": 32},
    "closed_rope96": {**LONG_CLOSED, "rope_dim": 96},
}


def levers_options(parser) -> None:
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--lever", required=True, choices=list(LONG_LEVERS))
    parser.add_argument("--keep", required=True, help="folder: the conversion goes to KEEP/<lever>")
    parser.add_argument("--threads", type=int, default=1)


def levers(args) -> None:
    """One long-context lever of an MLA conversion converted into --keep/<lever>, then measured with the probe part.

        bench_long_context.py levers --lever uniform_ds --keep /tmp/i40w
        bench_long_context.py probe --model "uniform_ds=/tmp/i40w/uniform_ds" --texts wikitext --passkey 4096 \\
            --parts held_in,passage,passkey

    Every lever states all its options (nothing rides on convert()'s defaults); MLA 50% of the source's KV bytes:
        uniform_ds   --format deepseek_v3 (one rank and RoPE split for all layers), teacher 32 x 256,
                     reconstruction 60, RoPE scored over L = 256: what the stock DeepSeek shape gives up against the
                     per-layer default
        retrieval    native, --rank-allocation retrieval: the layers holding a copy head (measured on the source's
                     own samples, converters/methods/retrieval_heads.py) kept exact, the others share the rest
                     uniformly; otherwise as uniform_ds
        mixed        --calib-lengths 2048,1024,512,256,256: each calibration row packs teacher samples of these
                     lengths (positions restart per sample, attention stays within it), 2 rows = the default's
                     8,192 tokens; uniform ranks, reconstruction 60, L = the source's context (as the 1,024 recipe)
        recipe       the 1,024-window recipe of BENCHMARKS.md (teacher 8 x 1,024, uniform, reconstruction 60,
                     L = the source's context): the base the mixed lever changes one thing of
        closed_*     the closed form (text windows, uniform ranks, no reconstruction, L = the source's context) at
                     calibration lengths 256 / 1024 / 4096 / mixed, and RoPE dims 32 / 96 against the latent rank
    Teacher calibration samples are cached in --keep (safetensors), so levers with the same windows sample once.
    """
    from hf_attn_patch.converters.convert import convert
    from hf_attn_patch.converters.stages import windows as windows_stage

    torch.set_num_threads(args.threads)
    keep = Path(args.keep)
    windows_stage.teacher_windows = cached_teacher(keep / "teacher_cache", windows_stage.teacher_windows)
    started = time.perf_counter()
    report = convert(args.source, keep / args.lever, to="mla", kv_budget=0.5, overwrite=True, **LONG_LEVERS[args.lever])
    wall = round(time.perf_counter() - started, 1)
    layers = report.get("budgets", {}).get("layers")
    print(
        json.dumps({"lever": args.lever, "wall_s": wall, "stages": report.get("stages"), "budgets": layers}), flush=True
    )


# ------------------------------------------------------------------------------------------------------ retrieval
RETRIEVAL_TARGETS = {
    "GQA 3": ["--to", "gqa", "--kv-heads", "3"],
    "GQA 2": ["--to", "gqa", "--kv-heads", "2"],
    "MQA": ["--to", "mqa"],
    "MLA 50%": ["--to", "mla", "--kv-budget", "0.5"],
    "MLA 50% deepseek_v3": ["--to", "mla", "--kv-budget", "0.5", "--format", "deepseek_v3"],
    "MLA 25%": ["--to", "mla", "--kv-budget", "0.25"],
    "MLA 25% deepseek_v3": ["--to", "mla", "--kv-budget", "0.25", "--format", "deepseek_v3"],
}


def retrieval_windows(source: str, tokenizer) -> torch.Tensor:
    from hf_attn_patch.evaluation.perplexity import windows_of

    if source == "smollm2":
        return windows_of(benchlib.wikitext(), tokenizer, 512, 2048)
    return windows_of(read_calibration_text(None)[-60_000:], tokenizer, 256, 2048)


def zero_shot(model, tokenizer, limit: int) -> dict:
    from hf_attn_patch.evaluation.harness import OFFLINE_TAG, average_accuracy, run_tasks, task_manager

    scores = run_tasks(model, tokenizer, [OFFLINE_TAG], task_manager(), limit=limit, batch_size=8)
    return {"average": average_accuracy(scores), "tasks": {f"{s.task} {s.metric}": s.value for s in scores}}


def retrieval_options(parser) -> None:
    parser.add_argument("--source", default="smollm2", help="'smollm2', 'default' or a model folder")
    parser.add_argument("--work", required=True, help="folder of the conversions (reused when present)")
    parser.add_argument(
        "--targets",
        default="MLA 50%,MLA 50% deepseek_v3,MQA,MLA 25%",
        help="comma-separated, of " + str(list(RETRIEVAL_TARGETS)).replace("%", "%%"),  # argparse formats help with %
    )
    parser.add_argument("--items", type=int, default=8, help="retrieval items per task and distance")
    parser.add_argument("--smallest", type=int, default=16, help="shortest retrieval distance (default 16)")
    parser.add_argument("--tasks", default="passkey,copy,induction", help="retrieval tasks (comma-separated)")
    parser.add_argument("--largest", type=int, help="longest retrieval distance (default: the source's context)")
    parser.add_argument("--limit", type=int, default=200, help="lm-eval items per task (0: no lm-eval)")
    parser.add_argument(
        "--eval-data", default=str(benchlib.SHARED / "evals"), help="folder of the offline tasks' files"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--source-row",
        help="a rows JSON of an earlier run with the same settings: its source row is reused instead of measuring "
        "the source again",
    )
    parser.add_argument("--out", default=str(RESULTS / "retrieval.png"), help="the PNG; the rows go beside it (.json)")


def retrieval(args) -> None:
    """Context retrieval, zero-shot accuracy and perplexity of a source and its conversions, in one run.

    Each target is converted with the CLI's defaults (`hf-attn convert SRC OUT --to ...`: teacher calibration,
    reconstruction "auto", sensitivity rank allocation for native MLA), into --work/<slug> unless that folder exists
    (then it is reused: its conversion_report.json is read for the KV bytes). Per model:
        perplexity   on text never calibrated on: WikiText-2 test (first 200,000 characters, 4 x 512 tokens) for
                     SmolLM2, the last 60,000 characters of the package's TinyStories sample (8 x 256) otherwise;
                     ratio to the source's
        retrieval    evaluation/retrieval.py: passkey / copy / induction accuracy per distance (up to --largest,
                     else the source's context), --items per (task, distance), the source's vocabulary, seed 0
        accuracy     lm-eval zero-shot, the offline tasks (zero_shot_offline) on their first --limit items each;
                     average of acc_norm (winogrande: acc); retained = average / the source's
    Writes <out>.json (rows, after each model) and <out> (PNG: distance -> accuracy per task, one line per model).
    """
    from hf_attn_patch.evaluation.perplexity import evaluate
    from hf_attn_patch.evaluation.retrieval import (
        RetrievalResult,
        evaluate_retrieval,
        known_vocabulary,
        retained,
        table,
    )
    from hf_attn_patch.kv_memory import kv_cache_bytes

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        if t not in RETRIEVAL_TARGETS:
            raise SystemExit(f"--targets: {t!r} is not one of {list(RETRIEVAL_TARGETS)}")
    source_row = None
    if args.source_row:  # the source's row from an earlier run with the same settings, checked before any work
        source_row = json.loads(Path(args.source_row).read_text())[0]
        if source_row["model"] != "source" or source_row["retrieval"]["items"] != args.items:
            args.parser.error(
                f"--source-row {args.source_row}: its first row is {source_row['model']!r} with "
                f"{source_row['retrieval']['items']} items, not the source's with --items {args.items}"
            )
    torch.set_num_threads(args.threads)
    os.environ["HF_ATTN_EVAL_DATA"] = str(Path(args.eval_data).resolve())
    commit = benchlib.commit()
    rows_file = Path(args.out).with_suffix(".json")
    source, tokenizer = load_source(args.source)
    windows = retrieval_windows(args.source, tokenizer)
    vocab = known_vocabulary(source, tokenizer)
    rows, results = [], {}

    def measure(label, model, kv, report):
        started = time.perf_counter()
        ppl = evaluate(model, windows, progress=False).perplexity
        ret = evaluate_retrieval(
            model,
            tokenizer,
            items=args.items,
            largest=args.largest,
            smallest=args.smallest,
            vocab=vocab,
            tasks=tuple(args.tasks.split(",")),
        )
        acc = zero_shot(model, tokenizer, args.limit) if args.limit else None
        results[label] = ret
        seconds = round(time.perf_counter() - started, 1)
        row = dict(
            model=label, kv_bytes=kv, ppl=ppl, retrieval=ret.to_dict(), accuracy=acc, report=report, seconds=seconds
        )
        row["commit"] = commit
        if rows:
            base = rows[0]
            row["ppl_ratio"] = ppl / base["ppl"]
            kept = retained(ret, results[base["model"]])
            row["retrieval_retained"] = {t: {str(d): v for d, v in r.items()} for t, r in kept.items()}
            if acc:
                row["accuracy_retained"] = acc["average"] / base["accuracy"]["average"]
        rows.append(row)
        benchlib.write_rows(rows_file, rows)
        print(
            f"{label}: ppl {ppl:.3f}"
            + (f" (x{row['ppl_ratio']:.3f})" if "ppl_ratio" in row else "")
            + (f", accuracy {acc['average']:.4f}" if acc else "")
            + f", retrieval mean {ret.mean():.3f}"
            + f" [{row['seconds']:.0f} s]",
            flush=True,
        )

    if source_row is not None:
        results["source"] = RetrievalResult.from_dict(source_row["retrieval"])
        rows.append(source_row)
    else:
        measure("source", source, kv_cache_bytes(source.config, 1), None)
    for label in targets:
        out = Path(args.work) / label.lower().replace("%", "").replace(" ", "_")
        if not out.exists():
            cmd = [str(benchlib.ROOT / ".venv" / "bin" / "hf-attn"), "convert", args.source, str(out)]
            cmd += RETRIEVAL_TARGETS[label]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        report = json.loads((out / "conversion_report.json").read_text())
        model = load_model(out)
        measure(
            label, model, report["kv_bytes_per_token_fp16"]["after"], {k: report.get(k) for k in ("format", "options")}
        )
        del model
    print("\n" + table(results))
    if any(r["accuracy"] for r in rows):
        print(
            "\n| model | KV B/token | ppl ratio | average accuracy | retained | retrieval mean | retrieval min retained |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            kept = r.get("retrieval_retained", {}).values()
            worst = min((v for t in kept for v in t.values() if v is not None), default=1.0)
            acc = r["accuracy"]["average"] if r["accuracy"] else float("nan")
            print(
                f"| {r['model']} | {r['kv_bytes']} | {r.get('ppl_ratio', 1.0):.3f} | {acc:.4f} | "
                f"{r.get('accuracy_retained', 1.0):.3f} | {r['retrieval']['mean']:.3f} | {worst:.2f} |"
            )
    retrieval_plot(results, args.out, args.source)


def retrieval_plot(results: dict, path: str, title: str) -> None:
    plt = benchlib.pyplot()
    tasks = list(next(iter(results.values())).accuracy)
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for label, r in results.items():
            pts = sorted(r.accuracy[task].items())
            ax.plot(*zip(*pts), marker="o", label=label, linestyle="--" if label == "source" else "-")
        ax.set(
            xscale="log", xlabel="distance (tokens)", ylabel="accuracy", title=f"{title}: {task}", ylim=(-0.02, 1.02)
        )
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


# ---------------------------------------------------------------------------------------------------------- heads
def heads_options(parser) -> None:
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--segment", type=int, default=256)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--report", help="a conversion_report.json: print its per-layer (rope_dim, kv_lora_rank)")
    parser.add_argument("--out", default=str(RESULTS / "retrieval_heads.json"))


def heads(args) -> None:
    """Which heads copy: each source head's attention mass on the earlier copy of a repeated segment, beside the
    ranks a conversion gave each layer (the first step of retrieval-aware allocation, as DuoAttention /
    RazorAttention find retrieval heads).

    Items: teacher samples (the source's own continuations, seed 2, of 4-token prompts from the calibration corpus)
    of --segment tokens, S, fed as bos? + S + S. Copy score of a head: the mean over the second copy's queries at
    position i of the attention weight on i - segment + 1, the token that followed the query's earlier copy (what
    an induction / copy head attends to). A head that copies puts most of its mass there; chance is 1 / position.
    """
    from hf_attn_patch.converters.stages.retrieval import copy_scores

    source, tokenizer = load_source(args.source)
    source.set_attn_implementation("eager")  # SDPA returns no weights
    prompts = calibration_windows(read_calibration_text(None), tokenizer, args.samples, args.segment)
    segments = teacher_windows(source, prompts, seed=2, progress=False)
    with torch.no_grad():
        scores = copy_scores(source, segments)
    budgets = None
    if args.report:
        layers = json.loads(Path(args.report).read_text())["budgets"]["layers"]
        budgets = [(b["rope_dim"], b["kv_lora_rank"]) for b in layers]
    print("layer | copy score of the best 3 heads | heads > 0.3 | layer mean" + (" | (d_r, d_c)" if budgets else ""))
    for i, row in enumerate(scores):
        top = row.sort(descending=True).values[:3]
        cells = [f"{i:2d}", " ".join(f"{v:.2f}" for v in top), str(int((row > 0.3).sum())), f"{row.mean():.3f}"]
        print(" | ".join(cells + ([str(budgets[i])] if budgets else [])))
    scores = [[round(float(v), 4) for v in r] for r in scores]
    benchlib.write_rows(
        args.out, {"segment": args.segment, "samples": args.samples, "scores": scores, "budgets": budgets}
    )


# ----------------------------------------------------------------------------------------------- retrieval-levers
WINDOW = 256  # the calibration length: the RoPE score's default L
CLOSED = {"calib_source": "text", "rank_allocation": "uniform", "reconstruct_steps": 0, "rope_context": WINDOW}
DEFAULT = {
    "calib_source": "teacher",
    "rank_allocation": "sensitivity",
    "reconstruct_steps": 60,
    "rope_context": WINDOW,
    "reconstruct_attention_kl": 0.0,
}
CONTEXT = {"rope_context": "source"}  # the source's max_position_embeddings
RECIPE = {**DEFAULT, "rank_allocation": "uniform", "calib_len": 1024, "calib_samples": 8, **CONTEXT}
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
    "calib_1024_context": RECIPE,
    "attention_kl": {**DEFAULT, "reconstruct_attention_kl": 1.0},
    "attention_kl_uniform": {**DEFAULT, "rank_allocation": "uniform", "reconstruct_attention_kl": 1.0},
    "recipe_attention_kl": {**RECIPE, "reconstruct_attention_kl": 1.0},
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


def lever_model(source_name: str, source, lever: str, kv_budget: float, keep: Path | None):
    """The lever's conversion (kept in keep/<lever> and reused when present), and its report."""
    from hf_attn_patch.converters.convert import convert
    from hf_attn_patch.converters.methods import budgets
    from hf_attn_patch.converters.stages import plan as plan_stage

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
    model = load_model(folder)
    if keep is None:
        shutil.rmtree(folder.parent, ignore_errors=True)
    return model, report


def retrieval_levers_plot(rows: list[dict], png: str) -> None:
    """One panel per task: the accuracy retained (conversion / source) against distance, one line per lever."""
    plt = benchlib.pyplot()
    tasks = [t for t in rows[0]["retrieval"]["accuracy"]]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, row in enumerate(rows):
            if task not in row.get("retained", {}):  # the source, or a lever measured on other tasks
                continue
            points = sorted((int(d), v) for d, v in row["retained"][task].items() if v is not None)
            colour = plt.get_cmap("tab20")(i % 20)
            ax.plot([d for d, _ in points], [v for _, v in points], marker="o", label=row["lever"], color=colour)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.15)
        ax.axhline(0.95, color="grey", lw=0.8, ls="--")
        ax.set(title=f"{task}: retained (conversion / source)", xlabel="distance (tokens)", ylabel="retained")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines() if not h.get_label().startswith("_")}
    fig.legend(handles.values(), handles.keys(), fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(png, dpi=110)


def retrieval_levers_options(parser) -> None:
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--kv-budget", type=float, default=0.5)
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--smallest", type=int, default=64, help="shortest retrieval distance (default 64)")
    parser.add_argument("--tasks", default="passkey,copy", help="retrieval tasks (comma-separated)")
    parser.add_argument("--largest", type=int, default=1024)
    parser.add_argument("--levers", default=",".join(LEVERS))
    parser.add_argument("--keep", help="folder: converted models kept in KEEP/<lever> and reused when present")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "retrieval_levers.json"))
    parser.add_argument("--cache", default="/tmp/hfap-retrieval-levers", help="teacher samples cache")
    parser.add_argument("--held-in-len", type=int, default=2048, help="tokens per held-in sample (default 2048)")
    parser.add_argument(
        "--held-in-only",
        action="store_true",
        help="only (re)measure the held-in KL of the models kept in --keep, into --out's rows",
    )
    parser.add_argument("--plot", help="only draw --out's rows to this PNG (retained accuracy per distance) and exit")


def retrieval_levers(args) -> None:
    """What loses retrieval in an MLA conversion: the conversion's stages added one at a time, and candidate fixes,
    each measured on held-in teacher samples and on the retrieval probes.

    Every lever states all its options (nothing rides on convert()'s defaults):
        closed          text calibration (32 x 256), uniform ranks, no reconstruction: the closed form
        teacher         + teacher-sample calibration (32 x 256 samples of the source)
        teacher_sens    + sensitivity rank allocation (per-layer RoPE dims / ranks by measured KL)
        teacher_rec60   teacher calibration, uniform ranks, reconstruction 60 steps / layer
        sens_rec20      teacher + sensitivity + reconstruction 20
        default         teacher + sensitivity + reconstruction 60: the CLI's defaults
        measure_1024    default, the sensitivity KL measured on 1024 calibration tokens (budgets.MEASURE_TOKENS;
                        256 in the library) instead of one window
        calib_512       default, 16 x 512 calibration windows (the same 8,192 tokens; L = 512 in the RoPE score)
        calib_1024      default, 8 x 1024 windows (L = 1024)
        sens_m512       teacher_sens (no reconstruction), the sensitivity KL measured on 512 tokens (2 windows)
        sens_floor      teacher_sens (no reconstruction), no layer below 0.75 x the uniform share
                        (budgets.SIZE_FACTORS without 0.5)
        rope_context    teacher_rec60 with L = the source's context (max_position_embeddings) in the RoPE split's
                        score energy x 2(1 - sinc(theta L)) instead of the 256-token calibration window
                        (rope_context; the levers above state rope_context=256, the calibration length and the
                        library's default)
        default_context default (sensitivity + reconstruction 60) with L = the source's context in the RoPE score
        default_l1024   default with L = 1024 in the RoPE score
        calib_1024_context  teacher_rec60 on 8 x 1024 windows with L = the source's context in the RoPE score
        attention_kl    default, the reconstruction's objective adding 1.0 x the attention-pattern KL to the
                        source's (reconstruct_attention_kl; the levers above state 0)
        attention_kl_uniform  teacher_rec60 (uniform ranks) with reconstruct_attention_kl 1.0
        recipe_attention_kl  calib_1024_context (the long-context recipe) with reconstruct_attention_kl 1.0
        calib_1024_context_sens  calib_1024_context with sensitivity ranks: the KL measured on one 1,024-token window
    Held-in measure (chosen on, never the probes): mean KL(source || converted) per token on 4 samples of the source
    itself, --held-in-len (2048) tokens long, prompted by calibration-corpus windows after the 8,192 tokens
    calibrated on; split into positions < 256, 256-511, 512-1023 and >= 1024; "all" (every position alike) is the
    figure levers are compared by. Teacher calibration samples are cached in --cache (safetensors) and reused by
    every lever with the same windows and seed: after sensitivity, sampling is a conversion's costliest step on a
    CPU. Evaluation: retrieval accuracy per distance (hf_attn_patch/evaluation/retrieval.py; the source's
    vocabulary, seed 0). --keep DIR: converted models are kept in DIR/<lever> and reused when present;
    --held-in-only remeasures them.
    """
    from hf_attn_patch.converters.stages import windows as windows_stage
    from hf_attn_patch.evaluation.retrieval import RetrievalResult, evaluate_retrieval, known_vocabulary, retained

    if args.plot:
        retrieval_levers_plot(json.loads(Path(args.out).read_text()), args.plot)
        return
    unknown = [lever for lever in args.levers.split(",") if lever not in LEVERS]
    if unknown:
        args.parser.error(f"--levers: {unknown} not in {list(LEVERS)}")
    if args.held_in_only and not args.keep:
        args.parser.error("--held-in-only measures the models kept in --keep DIR: give --keep")
    torch.set_num_threads(args.threads)
    source, tokenizer = load_source(args.source)
    text = read_calibration_text(None)
    samples = cached_teacher(Path(args.cache))
    windows_stage.teacher_windows = samples  # the conversions' teacher calibration samples, cached the same way
    first = -(-CALIBRATED_TOKENS // args.held_in_len)  # the first window after the tokens every lever calibrates on
    prompts = calibration_windows(text, tokenizer, first + 4, args.held_in_len)[first:]
    held = samples(source, prompts, seed=1, progress=False)
    out = Path(args.out)
    if args.held_in_only:  # the held-in KL of models kept in --keep, written into their rows
        rows = json.loads(out.read_text())
        for row in rows:
            folder = Path(args.keep) / row["lever"]
            if row["lever"] in args.levers.split(",") and (folder / "config.json").exists():
                row["held_in_kl"] = position_kl(load_model(folder), source, held)
                print(row["lever"], {k: round(v, 4) for k, v in row["held_in_kl"].items()}, flush=True)
                benchlib.write_rows(out, rows)
        return
    vocab = known_vocabulary(source, tokenizer)
    probe = dict(
        items=args.items, largest=args.largest, smallest=args.smallest, vocab=vocab, tasks=tuple(args.tasks.split(","))
    )
    rows = json.loads(out.read_text()) if out.exists() else []
    key = {"items": args.items, "tasks": args.tasks, "smallest": args.smallest, "largest": args.largest}
    rows = [r for r in rows if r.get("probe") == key]  # rows of other probe settings are dropped
    base_row = next((r for r in rows if r["lever"] == "source"), None)
    if base_row is None:
        base = evaluate_retrieval(source, tokenizer, **probe)
        rows.append({"lever": "source", "probe": key, "retrieval": base.to_dict()})
        benchlib.write_rows(out, rows)
    else:  # the source's figures, as computed by an earlier run with the same probes
        base = RetrievalResult.from_dict(base_row["retrieval"])
    print("source", {t: list(a.values()) for t, a in base.accuracy.items()}, flush=True)
    keep = Path(args.keep) if args.keep else None
    for lever in args.levers.split(","):
        started = time.perf_counter()
        model, report = lever_model(args.source, source, lever, args.kv_budget, keep)
        kl = position_kl(model, source, held)
        result = evaluate_retrieval(model, tokenizer, **probe)
        keep_share = retained(result, base)
        layerwise = report.get("layerwise", {})
        rows = [r for r in (json.loads(out.read_text()) if out.exists() else rows) if r["lever"] != lever]
        rows.append(
            {
                "lever": lever,
                "probe": key,
                "options": LEVERS[lever],
                "held_in_kl": kl,
                "conversion_wall_s": report.get("wall_time_s"),
                "reconstruction_error": [layerwise.get("mean_closed_form_error"), layerwise.get("mean_error")],
                "budgets": [(b["rope_dim"], b["kv_lora_rank"]) for b in report.get("budgets", {}).get("layers", [])],
                "retrieval": result.to_dict(),
                "retained": {t: {str(d): v for d, v in r.items()} for t, r in keep_share.items()},
            }
        )
        seconds = f"{time.perf_counter() - started:.0f} s"
        print(lever, "held-in KL", {k: round(v, 4) for k, v in kl.items()}, result.to_dict(), seconds, flush=True)
        benchlib.write_rows(out, rows)


# ------------------------------------------------------------------------------------------------------ latent-kv
DISTANCES = (256, 512, 1024, 2048, 4096)


@torch.no_grad()
def layer_covariances(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per attention layer: the input second moment [D + 1, D + 1] (a constant 1 appended) over the windows."""
    from hf_attn_patch.converters.io.calibration import stats_of_inputs
    from hf_attn_patch.converters.methods.exact import stock_attention_layers
    from hf_attn_patch.models.architectures import AttentionShape

    shape = AttentionShape.of(model.config)
    layers = list(stock_attention_layers(model).values())
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]

    def keep(i):
        return lambda mod, args, kw: inputs[i].append((args[0] if args else kw["hidden_states"]).detach())

    hooks = [m.register_forward_pre_hook(keep(i), with_kwargs=True) for i, m in enumerate(layers)]
    try:
        for batch in windows.split(8):
            model(batch)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, attn in enumerate(layers):
        w = shape.arch.split_heads(attn).cpu()
        out.append(stats_of_inputs(torch.cat(inputs[i]), w, shape).input_cov)
        inputs[i] = []
    return out


def latent_kv_model(source, covs, shape, setting: str, budget: float, windows):
    """The latent_kv model of one setting, built in memory (the source is not touched) -> (model, choices)."""
    from hf_attn_patch.converters.methods.exact import rebuild, stock_attention_layers
    from hf_attn_patch.converters.methods.latent_kv import latent_kv_layer
    from hf_attn_patch.converters.stages.closed_form import LatentChoice
    from hf_attn_patch.converters.stages.retrieval import (
        SAMPLES,
        SEGMENT,
        copy_kv_heads,
        copy_scores,
        kv_copy_scores,
        latent_retrieval_choices,
    )
    from hf_attn_patch.converters.targets.latent_kv import latent_kv_sizes

    share, context, metric, *rest = setting.split("/")
    key_rank, value_rank = latent_kv_sizes(budget, float(share), shape)
    choices = [LatentChoice(key_rank, value_rank)] * shape.layers
    if rest == ["retrieval"]:
        per_kv = kv_copy_scores(copy_scores(source, windows[:SAMPLES, :SEGMENT]), shape.kv_heads)
        choices = latent_retrieval_choices(
            copy_kv_heads(per_kv), choices[0], shape.layers, shape.head_dim, shape.kv_heads
        )
    lifted = {}
    for (name, attn), cov, c in zip(stock_attention_layers(source).items(), covs, choices):
        w = shape.arch.split_heads(attn).cpu()
        lifted[name] = latent_kv_layer(
            w, shape, cov, c.key_rank, c.value_rank, int(context), c.exact_key_heads, metric=metric
        )
    fields = {"latent_key_rank": [c.key_rank for c in choices], "latent_value_rank": [c.value_rank for c in choices]}
    return rebuild(source, "latent_kv", fields, lifted), choices


def latent_kv_options(parser) -> None:
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--kv-budget", type=float, default=0.5)
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["0.333/4096/weighted"],
        help="KEY_SHARE/ROPE_CONTEXT/METRIC[/retrieval] (the part's description)",
    )
    parser.add_argument("--held-in", default="4x1024", help="NxL windows of the held-in KL")
    parser.add_argument(
        "--held-in-data",
        default="text",
        choices=("text", "teacher"),
        help="held-in KL windows: the corpus after the calibration prompts (default), or teacher samples prompted "
        "from it (seed 1)",
    )
    parser.add_argument("--repeat", default=",".join(map(str, DISTANCES)), help="repeat KL distances D")
    parser.add_argument("--repeat-items", type=int, default=2, help="items per distance")
    parser.add_argument("--keep", default=None, help="save each setting's model under this folder")
    parser.add_argument("--out", default=None, help="append each setting's row (JSON lines) to this file")
    parser.add_argument("--cache", default="/tmp/hfap-latent-kv")
    parser.add_argument("--threads", type=int, default=2)


def latent_kv(args) -> None:
    """Latent K/V levers on the held-in criteria: the closed form (converters/methods/latent_kv.py) at several key
    shares, key-metric contexts, metrics and retrieval allocations, each converted in memory from one set of
    calibration statistics and scored against the source on held-in text only.

        OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_long_context.py latent-kv [--source smollm2] \\
            [--kv-budget 0.5] [--settings 0.333/4096/weighted 0.5/4096/weighted ...] [--keep DIR] [--out FILE]

    A setting is KEY_SHARE/ROPE_CONTEXT/METRIC[/retrieval]: METRIC `weighted` (query second moments through RoPE
    for keys, o_proj for values) or `plain` (unweighted PCA of the K / V outputs); `retrieval`: the copy KV heads
    keep exact keys at the same total KV values.
    Calibration: the converter's default, 32 teacher samples of 256 tokens (seed 0) prompted from the package's
    corpus. Criteria (held-in: never evaluation text):
        held-in KL   KL(source || model) per token on N windows of L tokens of the corpus after its first 8,192
                     tokens (--held-in-data text), or teacher samples prompted from them (teacher, seed 1), short
                     (< 256) and by position bin (evaluation/held_in.py);
        repeat KL    KL on the second copy of S + F + S, S 64 tokens of the corpus after its first 8,192 tokens,
                     the copy D tokens after the first (evaluation/held_in.py repeat_kl), D = 256 ... 4,096.
    --keep DIR saves each setting's model (DIR/<setting>) for the probe part. Samples, statistics and the source's
    log-probabilities are cached in --cache.
    """
    from hf_attn_patch.evaluation.held_in import (
        long_context_kl,
        repeat_items,
        repeat_kl,
        repeat_source_log_probs,
        source_log_probs,
    )
    from hf_attn_patch.models.architectures import AttentionShape

    bad = [
        s
        for s in args.settings
        if len(s.split("/")) not in (3, 4)
        or s.split("/")[2] not in ("weighted", "plain")
        or s.split("/")[3:] not in ([], ["retrieval"])
    ]
    if bad:
        args.parser.error(f"--settings {bad}: expected KEY_SHARE/ROPE_CONTEXT/weighted|plain[/retrieval]")
    torch.set_num_threads(args.threads)
    source, tokenizer = load_source(args.source)
    shape = AttentionShape.of(source.config)
    cache = Path(args.cache) / Path(args.source).name
    text = read_calibration_text(None)
    started = time.perf_counter()
    calib = benchlib.cached(
        cache / "calibration_32x256.safetensors",
        lambda: teacher_windows(source, calibration_windows(text, tokenizer, 32, 256), seed=0),
    )
    covs_path = cache / "covariances.pt"
    if covs_path.exists():
        covs = torch.load(covs_path, weights_only=True)
    else:
        covs = layer_covariances(source, calib)
        torch.save(covs, covs_path)
    n, length = (int(x) for x in args.held_in.split("x"))
    first = math.ceil(CALIBRATED_TOKENS / length)
    prompts = calibration_windows(text, tokenizer, first + n, length)[first:]
    if args.held_in_data == "text":  # the corpus itself after the calibration prompts (no sampling: fast)
        held = prompts
    else:
        held = benchlib.cached(
            cache / f"held_in_{n}x{length}.safetensors", lambda: teacher_windows(source, prompts, seed=1)
        )
    held_logp = benchlib.cached(
        cache / f"held_in_{args.held_in_data}_{n}x{length}_source_logp.safetensors",
        lambda: source_log_probs(source, held),
    )
    stream = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0][CALIBRATED_TOKENS:]
    distances = tuple(int(d) for d in args.repeat.split(","))
    items = repeat_items(stream, distances, args.repeat_items, 64, seed=0)
    repeat_logp = benchlib.cached(
        cache / f"repeat_{args.repeat}_{args.repeat_items}.safetensors", lambda: repeat_source_log_probs(source, items)
    )
    seconds = time.perf_counter() - started
    print(f"calibration, statistics and the source's log-probabilities: {seconds:.0f} s", flush=True)
    for setting in args.settings:
        started = time.perf_counter()
        model, choices = latent_kv_model(source, covs, shape, setting, args.kv_budget, calib)
        row = {
            "setting": setting,
            "kv_budget": args.kv_budget,
            "key_ranks": sorted({c.key_rank for c in choices}),
            "value_ranks": sorted({c.value_rank for c in choices}),
            "exact_key_heads": [(layer, g) for layer, c in enumerate(choices) for g in c.exact_key_heads],
            "held_in_kl": long_context_kl(model, held_logp, held),
            "repeat_kl": repeat_kl(model, repeat_logp, items),
            "seconds": round(time.perf_counter() - started),
        }
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        if args.keep:
            model.save_pretrained(Path(args.keep) / setting.replace("/", "_"))
            tokenizer.save_pretrained(Path(args.keep) / setting.replace("/", "_"))
        del model


# ---- text: which text a long-context conversion should calibrate and heal on ----

HEAL_TEXTS = ("general", "teacher", "mix", "stories")
TEACHER_SAMPLES, TEACHER_LEN = 32, 1024  # the teacher text: 4x the tokens of the default calibration samples
TEXT_REPEAT, TEXT_FACTS = (200, 1000, 3000), (1000, 3000)
FACT_ITEMS = 24  # a fact item is right or wrong as a whole: more of them than the passages' 8 (127 tokens each)
# passkey items hold ~distance tokens, copy items 2 x distance: both reach a 4,096-token context
TEXT_SYNTHETIC = {"passkey": (1024, 2048, 4096), "copy": (1024, 2048)}


def probe_domains() -> dict[str, str]:
    """The two held-out domains of the text part: encyclopedic (the first 200,000 characters of WikiText-2 test:
    other articles than the shipped corpus) and python-docs (CPython's own reference documentation, pydoc_data)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return {"encyclopedic": benchlib.wikitext(), "python-docs": "\n\n".join(topics[k] for k in sorted(topics))}


def text_calibration(name: str, out: Path, source, tokenizer) -> str:
    """The --calib-data value of a healing text; the teacher's samples are drawn once and kept as a text file."""
    if name in ("general", "stories"):
        return name
    path = out / "teacher_samples.txt"
    if not path.exists():
        started = time.perf_counter()
        prompts = calibration_windows(read_calibration_text("general"), tokenizer, TEACHER_SAMPLES, TEACHER_LEN)
        samples = teacher_windows(source, prompts, seed=0)
        path.write_text("\n\n".join(tokenizer.decode(s, skip_special_tokens=True) for s in samples))
        print(f"teacher samples: {time.perf_counter() - started:.0f} s", flush=True)
    if name == "teacher":
        return str(path)
    mixed = out / "mix.txt"
    mixed.write_text(read_calibration_text("general") + "\n\n" + path.read_text())
    return str(mixed)


def text_measure(model, tokenizer, vocab, domains: dict[str, str], reference=None) -> dict:
    """Every probe of the text part on one model: repeated passages and fact recall on both domains, passkey and
    random-token copy, perplexity (and KL to the reference) on 6 x 512 encyclopedic tokens."""
    from hf_attn_patch.evaluation.passage import evaluate_passages
    from hf_attn_patch.evaluation.perplexity import evaluate, windows_of
    from hf_attn_patch.evaluation.retrieval import make_batch, score

    started = time.perf_counter()
    accuracy = evaluate_passages(model, tokenizer, domains, TEXT_REPEAT, items=8).to_dict()["accuracy"]
    facts = evaluate_passages(model, tokenizer, domains, (), items=FACT_ITEMS, facts=TEXT_FACTS)
    accuracy.update(facts.to_dict()["accuracy"])
    for index, task in enumerate(("passkey", "copy")):  # evaluate_retrieval's seeds (task index 0, 1)
        accuracy[task] = {}
        for d in TEXT_SYNTHETIC[task]:
            batch = make_batch(task, tokenizer, vocab, d, 4, torch.Generator().manual_seed(index * 100_003 + d))
            accuracy[task][str(d)] = score(model, batch)
    ppl = evaluate(model, windows_of(domains["encyclopedic"], tokenizer, 512, 6 * 512), reference, progress=False)
    return {
        "accuracy": accuracy,
        "perplexity": ppl.perplexity,
        "kl": ppl.kl_to_reference,
        "probe_s": round(time.perf_counter() - started, 1),
    }


def text_table(reference: dict, rows: dict[str, dict]) -> str:
    """Markdown: each row's share of the source's accuracy per probe and distance, and its perplexity ratio."""
    columns = [(task, d) for task, acc in reference["accuracy"].items() for d in acc]
    lines = [
        "| conversion | " + " | ".join(f"{t} {d}" for t, d in columns) + " | ppl x |",
        "|---|" + "---:|" * (len(columns) + 1),
    ]
    for name, row in rows.items():
        cells = []
        for task, d in columns:
            src, ours = reference["accuracy"][task][d], row["accuracy"][task].get(d)
            cells.append("-" if ours is None else f"{ours / src:.0%}" if src else f"({ours:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['perplexity'] / reference['perplexity']:.2f} |")
    return "\n".join(lines)


def text_options(parser) -> None:
    parser.add_argument("--out", required=True, help="folder for the conversions and their rows (kept: large)")
    parser.add_argument("--texts", default="general,teacher,mix", help=f"comma-separated, of {HEAL_TEXTS}")
    parser.add_argument("--to", default="latent_kv", choices=("latent_kv", "mla"))
    parser.add_argument("--kv-budget", type=float, default=0.5)
    parser.add_argument("--format", default=None, help="e.g. deepseek_v3 (with --to mla)")
    parser.add_argument("--heal-len", type=int, default=None, help="healing windows (default: the preset's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--table", action="store_true", help="only print the table of the rows in --out")


def text(args) -> None:
    """The whole `--context long` conversion of SmolLM2-135M once per text, each probed beside the source.

    Texts (calibration and healing; never the probes' text): general, the shipped encyclopedic corpus (`--calib-data
    general`: WikiText-2 articles after the first 200,000 characters of the test split, which the probes read);
    teacher, the source's own samples (TEACHER_SAMPLES x TEACHER_LEN tokens, temperature 1, top-p 0.95, seed 0,
    prompted by the first 4 tokens of windows of the general corpus as `--calib-source teacher` prompts), written as
    a text file for `--calib-data`; mix, the two one after the other in one file; stories, the TinyStories sample.
    Probes, the same items for the source and every conversion: a passage repeated D = 200 / 1,000 / 3,000 tokens
    later (8 items a cell) and a fact recalled D = 1,000 / 3,000 tokens later (24), on two held-out domains
    (probe_domains);
    passkey at 1,024 / 2,048 / 4,096 and random-token copy at 1,024 / 2,048 (items of 2 x D tokens), 4 items;
    perplexity on 6 x 512 encyclopedic tokens. Rows: OUT/source.json and OUT/<to><budget>_<text>.json; the table of
    shares of the source at the end."""
    from transformers import AutoModelForCausalLM

    from hf_attn_patch.converters.convert import convert
    from hf_attn_patch.evaluation.retrieval import known_vocabulary

    out = Path(args.out)
    if args.table:
        rows = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem != "source"}
        print(text_table(json.loads((out / "source.json").read_text()), rows))
        return
    texts = [t.strip() for t in args.texts.split(",")]
    if any(t not in HEAL_TEXTS for t in texts):
        args.parser.error(f"--texts {args.texts!r}: each must be one of {HEAL_TEXTS}")
    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    source, tokenizer = load_source("smollm2")
    domains = probe_domains()
    vocab = known_vocabulary(source, tokenizer)
    if not (out / "source.json").exists():
        benchlib.write_rows(out / "source.json", text_measure(source, tokenizer, vocab, domains))
    reference = json.loads((out / "source.json").read_text())
    for name in texts:
        tag = f"{args.to}{round(args.kv_budget * 100)}{'_' + args.format if args.format else ''}_{name}"
        calib = text_calibration(name, out, source, tokenizer)
        options = {"format": args.format} if args.format else {}
        if args.heal_len:
            options["heal_len"] = args.heal_len
        started = time.perf_counter()
        report = convert(
            "smollm2",
            out / tag,
            to=args.to,
            kv_budget=args.kv_budget,
            context="long",
            calib_data=calib,
            overwrite=True,
            **options,
        )
        seconds = time.perf_counter() - started
        model = AutoModelForCausalLM.from_pretrained(out / tag).eval()
        row = {
            "text": name,
            "to": args.to,
            "kv_budget": args.kv_budget,
            "format": args.format,
            "commit": benchlib.commit(),
            "convert_s": round(seconds, 1),
            "heal_s": report["heal"]["seconds"],
            "held_in_kl": report["heal"]["held_in_kl"],
            **text_measure(model, tokenizer, vocab, domains, source),
        }
        benchlib.write_rows(out / f"{tag}.json", row)
        print(text_table(reference, {tag: row}), flush=True)


# ---- step-cost: what one retrieval healing step costs with the LM head at every position or only where weighed ----


def step_cost_options(parser) -> None:
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--student", required=True, help="a converted model folder (native format)")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (full, weighted) steps, interleaved")
    parser.add_argument("--steps", type=int, default=3, help="steps per mode and round")
    parser.add_argument("--threads", type=int, default=2)


def step_cost(args) -> None:
    """Seconds per retrieval healing step (converters/fitting/heal.py `_step`, lr 2e-5, batch 1) with the teacher's
    and the student's LM head and log-softmax at every position ("full", as before) or only at the weighted ones
    ("weighted", `weighted_positions`), in interleaved rounds in one process, the same windows for both; the loss of
    both modes on the first window, which must agree (the same math at the positions that count)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from hf_attn_patch.converters.fitting import heal as heal_module
    from hf_attn_patch.converters.fitting.heal_masters import MasterWeights
    from hf_attn_patch.converters.io.heal_data import retrieval_windows

    torch.set_num_threads(args.threads)
    source, tokenizer = load_source(args.source)
    student = AutoModelForCausalLM.from_pretrained(args.student).eval()
    stream = tokenizer(read_calibration_text("general"), return_tensors="pt", add_special_tokens=False).input_ids[0]
    data = retrieval_windows(stream, tokenizer, args.steps, args.length, seed=0, mix={"repeat": 1.0})
    params = heal_module._trainable(student, "attention")
    for p in student.parameters():
        p.requires_grad_(p in set(params))
    masters = MasterWeights(params)
    optimizer = torch.optim.AdamW(masters.tensors, lr=2e-5)
    accelerator = Accelerator(cpu=True)
    weighted_positions = heal_module.weighted_positions
    modes = {"full": lambda weights: None, "weighted": weighted_positions}
    seconds = {mode: [] for mode in modes}
    losses = {}
    student.train()
    for _ in range(args.rounds):
        for mode, positions in modes.items():
            heal_module.weighted_positions = positions
            try:
                for i in range(args.steps):
                    state = masters.copy()
                    started = time.perf_counter()
                    loss = heal_module._step(
                        student,
                        source,
                        optimizer,
                        masters,
                        data.ids[i : i + 1],
                        data.weights[i : i + 1],
                        0.0,
                        accelerator,
                    )
                    seconds[mode].append(time.perf_counter() - started)
                    masters.restore(state)  # every step starts from the same weights
                    losses.setdefault(mode, loss.item())
            finally:
                heal_module.weighted_positions = weighted_positions
    mean = {mode: sum(v) / len(v) for mode, v in seconds.items()}
    print(
        json.dumps(
            {
                "length": args.length,
                "threads": args.threads,
                "steps": len(seconds["full"]),
                "s_per_step": {m: round(v, 2) for m, v in mean.items()},
                "speedup": round(mean["full"] / mean["weighted"], 3),
                "first_loss": losses,
            }
        )
    )


PARTS: dict[str, benchlib.Part] = {
    "probe": (probe_options, probe),
    "heal": (heal_options, heal),
    "levers": (levers_options, levers),
    "retrieval": (retrieval_options, retrieval),
    "heads": (heads_options, heads),
    "retrieval-levers": (retrieval_levers_options, retrieval_levers),
    "latent-kv": (latent_kv_options, latent_kv),
    "text": (text_options, text),
    "step-cost": (step_cost_options, step_cost),
}

if __name__ == "__main__":
    benchlib.run_parts(__doc__, PARTS)
