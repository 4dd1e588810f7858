"""Speculative decoding vs plain generate(), in one process: n-gram lookup and a drafter built by `hf-attn draft`.

    hf-attn draft smollm2 DRAFTER
    flock /tmp/hfap-bench.lock .venv/bin/python scripts/bench_speculative.py --drafter DRAFTER \\
        [--new-tokens 64] [--threads 1] [--clock process] [--batches 1,4,8]

Target: SmolLM2-135M-Instruct (fp32, CPU), greedy. Prompt sets:
- open-ended, chat: "Continue this story: <a span>" with spans from the held-out tail of the calibration text (the
  drafter's prompts come from the first 90% of it, converters/drafting/samples.py), chat template;
- open-ended, plain: the first sentence of a held-out story, continued without a template;
- free writing: a story from a one-line premise (chat);
- input-grounded: rewrite / fix / summarize a given passage (the output copies spans of the input: n-gram lookup
  finds them).
Batch sizes 1 / 4 / 8 (prompts cycled to fill a batch). Methods: plain generate(); ours with n-gram lookup
(prompt_lookup_num_tokens=8, adaptive length); the drafter with the adaptive length; the drafter with a fixed draft
length of 4 (its accepted length is the figure to compare); both together (lookup where a row repeats, the drafter
elsewhere). Every output is checked token-identical to plain greedy.
Prints tokens/s, speed-up over plain, drafts accepted per verification step and tokens per step, and the drafter's
build report (build time, memory, size). `--clock process` times this process's CPU time (steadier on a shared
machine; use it with --threads 1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch  # noqa: F401  (registers the drafter class, our speculative loop)
from hf_attn_patch.compat import cache_kwarg, get_cache
from hf_attn_patch.converters.drafting.samples import HELD_IN
from hf_attn_patch.converters.io.calibration import DEFAULT_CORPUS, read_calibration_text
from hf_attn_patch.models.pretrained import load_smollm2
from hf_attn_patch.speculative import SpeculativeStats

PASSAGE = [
    "The city council met on Tuesday to discuss the new bike lanes on Main Street. Several shop owners said the "
    "lanes took away parking spaces that their customers needed, while cyclists said the lanes made the street "
    "much safer. The council agreed to study traffic for three more months before making a final decision.",
    "Our team moved the weekly planning meeting from Monday morning to Wednesday afternoon because too many people "
    "were out on Mondays. Please update your calendars, bring your status notes, and send any agenda items to Maria "
    "by Tuesday evening so she can share the agenda before the meeting.",
    "Photosynthesis is the process plants use to turn light into chemical energy. Inside the chloroplasts, light "
    "energy splits water molecules, releasing oxygen, and the energy is stored in sugar made from carbon dioxide. "
    "This process feeds almost every food chain on Earth.",
    "The library will close early on Friday for staff training. Books that are due on Friday can be returned on "
    "Saturday without a late fee. The children's reading hour is moved to Saturday at ten in the morning.",
]
GROUNDED = [
    f"{task}\n\n{text}"
    for task, text in zip(
        [
            "Rewrite this paragraph so it is easier to read:",
            "Fix any grammar mistakes in this text and return it:",
            "Repeat this text, then add one sentence that summarizes it:",
            "Rewrite this notice in a friendly tone:",
        ],
        PASSAGE,
    )
]
FREE = [
    "Write a short story about a robot who learns to paint.",
    "Write a story about a girl who finds a secret door in her school.",
    "Tell me a story about a dragon who is afraid of the dark.",
    "Write a short adventure story about two friends lost in a forest.",
]


def held_out_openings(count: int) -> list[str]:
    """First sentences of stories in the calibration text's held-out tail (never a drafter's prompt)."""
    text = read_calibration_text(DEFAULT_CORPUS)
    stories = [s.strip() for s in text[int(len(text) * HELD_IN) :].split("\n\n")[1:] if len(s.strip()) > 80]
    return [story.split(". ")[0] + "." for story in stories[:count]]


def encode(tokenizer, prompts, chat: bool):
    if chat:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    return tokenizer(prompts, return_tensors="pt", padding=True)


def run(model, enc, new_tokens, clock, **kw):
    """(seconds, output, stats)."""
    stats = SpeculativeStats() if kw else None
    extra = {"speculative_stats": stats} if kw else {}
    start = clock()
    out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, **kw, **extra)
    return clock() - start, out, stats


@torch.no_grad()
def step_costs(model, drafter, batches, clock, context: int = 200, repeats: int = 10) -> None:
    """The arithmetic of speculation: a target forward of n = 1 / 3 / 5 tokens per row on a `context`-token cache
    (verifying k = 0 / 2 / 4 drafts) and one drafter step, in ms, per batch size."""
    from transformers import DynamicCache

    drafter.bind(model)
    print("| batch | target 1 token | 3 tokens (k=2) | 5 tokens (k=4) | drafter step |")
    print("|---|---|---|---|---|")
    for batch in batches:
        ids = torch.randint(0, model.config.vocab_size, (batch, context))
        cache = get_cache(model(ids, use_cache=True))
        mine = DynamicCache(config=drafter.config)
        drafter(ids, torch.zeros(batch, context, drafter.config.hidden_size), **cache_kwarg(mine), logits_to_keep=1)

        def timed(forward, cache, n):
            start = clock()
            for _ in range(repeats):
                forward(n)
                cache.crop(-n)  # back to `context` columns
            return (clock() - start) / repeats * 1e3

        target = [timed(lambda n: model(ids[:, :n], **cache_kwarg(cache)), cache, n) for n in (1, 3, 5)]
        hidden = torch.zeros(batch, 1, drafter.config.hidden_size)
        draft = timed(lambda n: drafter(ids[:, :n], hidden, **cache_kwarg(mine), logits_to_keep=1), mine, 1)
        print(
            f"| {batch} | {target[0]:.1f} | {target[1]:.1f} ({target[1] / target[0]:.2f}x) | {target[2]:.1f} "
            f"({target[2] / target[0]:.2f}x) | {draft:.1f} ({draft / target[0]:.1%}) |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="a folder written by `hf-attn draft smollm2 OUT`")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--sets", default="open-ended chat,open-ended plain,free writing,input-grounded")
    parser.add_argument("--clock", choices=["wall", "process"], default="process")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "process" else time.perf_counter
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    tok.padding_side = "left"
    drafter = AutoModelForCausalLM.from_pretrained(args.drafter).eval()
    openings = held_out_openings(8)
    sets = {
        "open-ended chat": ([f"Continue this story: {s}" for s in openings], True),
        "open-ended plain": (openings, False),
        "free writing": (FREE, True),
        "input-grounded": (GROUNDED, True),
    }
    methods = {
        "n-gram": dict(prompt_lookup_num_tokens=8),
        "drafter": dict(assistant_model=drafter),
        "drafter k=4": dict(assistant_model=drafter, draft_length=4),
        "n-gram + drafter": dict(assistant_model=drafter, prompt_lookup_num_tokens=8),
    }
    report = json.loads((Path(args.drafter) / "drafter_report.json").read_text())
    print(
        "drafter:",
        json.dumps(
            {
                k: report.get(k)
                for k in (
                    "build_s",
                    "sampling_s",
                    "training_s",
                    "peak_rss_mb",
                    "size_mb",
                    "sample_tokens",
                    "draft_vocab",
                    "steps",
                    "held_in_top1_agreement_by_depth",
                )
            }
        ),
    )
    run(model, encode(tok, FREE[:1], True), 8, clock)  # warm-up
    step_costs(model, drafter, [int(b) for b in args.batches.split(",")], clock)
    print(
        f"SmolLM2-135M-Instruct fp32, CPU threads={args.threads}, greedy, max_new_tokens={args.new_tokens}, "
        f"{args.clock} clock"
    )
    print("| prompts | batch | method | tokens/s | speed-up | identical | accepted/step | tokens/step | draft time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.sets.split(","):
        prompts, chat = sets[name]
        for batch in (int(b) for b in args.batches.split(",")):
            enc = encode(tok, [prompts[i % len(prompts)] for i in range(batch)], chat)
            seconds, reference, _ = run(model, enc, args.new_tokens, clock)
            generated = int((reference[:, enc.input_ids.shape[1] :] != tok.pad_token_id).sum())
            print(f"| {name} | {batch} | plain | {generated / seconds:.1f} | 1.00x | - | - | - | - |", flush=True)
            for method, kw in methods.items():
                t, out, stats = run(model, enc, args.new_tokens, clock, **kw)
                summary = stats.summary()
                print(
                    f"| {name} | {batch} | {method} | {generated / t:.1f} | {seconds / t:.2f}x | "
                    f"{torch.equal(out, reference)} | {summary['mean_accepted_per_step']:.2f} | "
                    f"{summary['tokens_per_step']:.2f} | {summary['drafter_time_share']:.0%} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
