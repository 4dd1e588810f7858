"""Speculative decoding vs plain generate() and vs transformers' own assisted generation, in one process.

    .venv/bin/python scripts/bench_speculative.py [--new-tokens 128] [--threads 2] [--repeats 2] [--clock process]

Target: SmolLM2-135M-Instruct (fp32, CPU), greedy. Two prompt sets of chat requests users send:
- input-grounded: rewrite / fix / summarize a given passage (the output copies spans of the input: n-gram lookup
  finds them);
- free writing: a story from a one-line premise (little to copy).
Batch 1 and 4. Methods: plain generate(); ours with n-gram lookup (prompt_lookup_num_tokens=8, adaptive length);
ours with layer-skip self-drafting (assistant_early_exit=15 of 30 layers: SmolLM2 was not trained for early exit,
so this is the bad-drafter case the adaptive length must keep cheap); transformers' own prompt lookup at batch 1
(run with the patch removed). Every output is checked token-identical to plain greedy generate().
Prints tokens/s, speed-up over plain, acceptance rate and mean accepted tokens per verification step.
`--clock process` times with this process's CPU time instead of wall time: steadier on a machine others load
(use it with --threads 1, where waiting threads cannot spin).
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_attn_patch
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
        ["Rewrite this paragraph so it is easier to read:", "Fix any grammar mistakes in this text and return it:",
         "Repeat this text, then add one sentence that summarizes it:", "Rewrite this notice in a friendly tone:"],
        PASSAGE,
    )
]  # fmt: skip
FREE = [
    "Write a short story about a robot who learns to paint.",
    "Write a story about a girl who finds a secret door in her school.",
    "Tell me a story about a dragon who is afraid of the dark.",
    "Write a short adventure story about two friends lost in a forest.",
]


def encode(tokenizer, prompts):
    chats = [[{"role": "user", "content": p}] for p in prompts]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return tokenizer(texts, return_tensors="pt", padding=True)


def run(model, enc, new_tokens, repeats, clock=time.perf_counter, **kw):
    """(best seconds, output, stats) over repeats."""
    best, out, stats = float("inf"), None, None
    for _ in range(repeats):
        stats = SpeculativeStats() if kw else None
        extra = {"speculative_stats": stats} if kw and "unpatched" not in kw else {}
        args = {k: v for k, v in kw.items() if k != "unpatched"}
        start = clock()
        if kw.get("unpatched"):
            with hf_attn_patch.unpatched():
                out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, **args)
        else:
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, **args, **extra)
        best = min(best, clock() - start)
    return best, out, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "process"], default="wall")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "process" else time.perf_counter
    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    tok.padding_side = "left"
    methods = {
        "ours n-gram": dict(prompt_lookup_num_tokens=8),
        "ours early-exit 15/30": dict(assistant_early_exit=15),
        "transformers n-gram": dict(prompt_lookup_num_tokens=8, unpatched=True),
    }
    run(model, encode(tok, FREE[:1]), 8, 1)  # warm-up
    print(f"SmolLM2-135M-Instruct fp32, CPU threads={args.threads}, greedy, max_new_tokens={args.new_tokens}, "
          f"best of {args.repeats}, {args.clock} clock")  # fmt: skip
    print("| prompts | batch | method | tokens/s | speed-up | identical | acceptance | accepted/step | draft time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, prompts in (("input-grounded", GROUNDED), ("free writing", FREE)):
        for batch in (1, 4):
            enc = encode(tok, prompts[:batch])
            seconds, reference, _ = run(model, enc, args.new_tokens, args.repeats, clock)
            generated = int((reference[:, enc.input_ids.shape[1] :] != tok.pad_token_id).sum())
            print(f"| {name} | {batch} | plain generate() | {generated / seconds:.1f} | 1.00x | - | - | - | - |")
            for method, kw in methods.items():
                if kw.get("unpatched") and batch > 1:
                    continue  # transformers refuses assisted generation for batch_size > 1
                t, out, stats = run(model, enc, args.new_tokens, args.repeats, clock, **kw)
                same = torch.equal(out, reference)
                cells = ("-", "-", "-") if kw.get("unpatched") else (
                    f"{stats.acceptance_rate:.2f}", f"{stats.mean_accepted_per_step:.2f}",
                    f"{stats.drafter_time_share:.0%}")  # fmt: skip
                print(f"| {name} | {batch} | {method} | {generated / t:.1f} | {seconds / t:.2f}x | {same} | "
                      f"{' | '.join(cells)} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
