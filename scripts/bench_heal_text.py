"""Which text should a long-context conversion calibrate and heal on? The whole `--context long` conversion of
SmolLM2-135M, once per text, each probed on held-out text of two domains beside the source.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_heal_text.py --out /tmp/heal_text \
        [--texts general,teacher,mix] [--to latent_kv] [--kv-budget 0.5] [--threads 2]

Texts (calibration and healing; never the probes' text):
    general  the shipped encyclopedic corpus (`--calib-data general`: WikiText-2 articles after the first 200,000
             characters of the test split, which the probes read);
    teacher  the source's own samples: TEACHER_SAMPLES continuations of TEACHER_LEN tokens (temperature 1, top-p 0.95,
             seed 0), prompted by the first 4 tokens of windows of the general corpus, as `--calib-source teacher`
             prompts them; written as a text file and given through `--calib-data`;
    mix      the two, one after the other, in one file (half of the retrieval windows cut from each);
    stories  the package's TinyStories sample (the earlier default).
Probes (evaluation/passage.py, retrieval.py), the same items for the source and every conversion:
    encyclopedic  the first 200,000 characters of ../shared/corpora/wikitext2_test.txt (other articles than the
                  shipped corpus);
    python-docs   the Python reference documentation that ships with CPython (pydoc_data.topics): technical prose and
                  code, a domain no text here calibrates on;
    repeated passage at D = 200 / 1,000 / 3,000 and fact recall at D = 1,000 / 3,000 on each, 8 items a cell;
    passkey and random-token copy at 1,024 / 2,048 / 4,096 (4 items); perplexity on 6 x 512 encyclopedic tokens.
Rows: <out>/<text>.json and <out>/source.json; a table of the shares of the source's accuracy at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text, teacher_windows
from hf_attn_patch.evaluation.passage import evaluate_passages
from hf_attn_patch.evaluation.perplexity import evaluate, windows_of
from hf_attn_patch.evaluation.retrieval import known_vocabulary, make_batch, score
from hf_attn_patch.models.pretrained import load_source

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
TEXTS = ("general", "teacher", "mix", "stories")
TEACHER_SAMPLES, TEACHER_LEN = 64, 1024
REPEAT, FACTS, SYNTHETIC = (200, 1000, 3000), (1000, 3000), (1024, 2048, 4096)


def probe_texts() -> dict[str, str]:
    import pydoc_data.topics

    docs = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return {"encyclopedic": (SHARED / "corpora" / "wikitext2_test.txt").read_text()[:200_000], "python-docs": docs}


def calibration_file(name: str, out: Path, source, tokenizer) -> str:
    """The --calib-data value of a text (module docstring); teacher samples are drawn once and kept as text."""
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


def measure(model, tokenizer, vocab, texts: dict[str, str], reference=None) -> dict:
    """Every probe of the module docstring on one model."""
    started = time.perf_counter()
    passages = evaluate_passages(model, tokenizer, texts, REPEAT, items=8, facts=FACTS).to_dict()["accuracy"]
    synthetic = {}
    for index, task in enumerate(("passkey", "copy")):  # evaluate_retrieval's seeds (task index 0, 1)
        synthetic[task] = {str(d): score(model, make_batch(task, tokenizer, vocab, d, 4,
                                                           torch.Generator().manual_seed(index * 100_003 + d)))
                           for d in SYNTHETIC}  # fmt: skip
    windows = windows_of(texts["encyclopedic"], tokenizer, 512, 6 * 512)
    ppl = evaluate(model, windows, reference, progress=False)
    return {"accuracy": {**passages, **synthetic}, "perplexity": ppl.perplexity, "kl": ppl.kl_to_reference,
            "probe_s": round(time.perf_counter() - started, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the conversions and the result rows")
    parser.add_argument("--texts", default="general,teacher,mix", help=f"comma-separated, of {TEXTS}")
    parser.add_argument("--to", default="latent_kv", choices=("latent_kv", "mla"))
    parser.add_argument("--kv-budget", type=float, default=0.5)
    parser.add_argument("--format", default=None, help="e.g. deepseek_v3 (with --to mla)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    texts = [t.strip() for t in args.texts.split(",")]
    if any(t not in TEXTS for t in texts):
        parser.error(f"--texts {args.texts!r}: each must be one of {TEXTS}")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source, tokenizer = load_source("smollm2")
    probes = probe_texts()
    vocab = known_vocabulary(source, tokenizer)
    if not (out / "source.json").exists():
        (out / "source.json").write_text(json.dumps(measure(source, tokenizer, vocab, probes), indent=1))
    reference = json.loads((out / "source.json").read_text())
    for name in texts:
        tag = f"{args.to}{round(args.kv_budget * 100)}{'_' + args.format if args.format else ''}_{name}"
        calib = calibration_file(name, out, source, tokenizer)
        started = time.perf_counter()
        options = {"format": args.format} if args.format else {}
        report = convert("smollm2", out / tag, to=args.to, kv_budget=args.kv_budget, context="long",
                         calib_data=calib, overwrite=True, **options)  # fmt: skip
        seconds = time.perf_counter() - started
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out / tag).eval()
        row = {"text": name, "to": args.to, "kv_budget": args.kv_budget, "format": args.format,
               "convert_s": round(seconds, 1), "heal_s": report["heal"]["seconds"],
               "held_in_kl": report["heal"]["held_in_kl"], **measure(model, tokenizer, vocab, probes, source)}  # fmt: skip
        (out / f"{tag}.json").write_text(json.dumps(row, indent=1))
        print(json.dumps({k: v for k, v in row.items() if k != "held_in_kl"}), flush=True)
        print(table(reference, {tag: row}), flush=True)


def table(reference: dict, rows: dict[str, dict]) -> str:
    """Markdown: each row's share of the source's accuracy per probe and distance, and its perplexity ratio."""
    columns = [(task, d) for task, acc in reference["accuracy"].items() for d in acc]
    head = "| conversion | " + " | ".join(f"{t} {d}" for t, d in columns) + " | ppl x |"
    lines = [head, "|---|" + "---:|" * (len(columns) + 1)]
    for name, row in rows.items():
        cells = []
        for task, d in columns:
            src, ours = reference["accuracy"][task][d], row["accuracy"][task][d]
            cells.append(f"{ours / src:.0%}" if src else f"({ours:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['perplexity'] / reference['perplexity']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
