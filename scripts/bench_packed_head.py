"""The engine with its packed lm_head (engine/packed_head.py) against the same engine running the model's own lm_head,
in one process, interleaved: offline greedy throughput at each batch size.

    flock /tmp/hfap-bench.lock .venv/bin/python scripts/bench_packed_head.py [--model stories15m|smollm2]
        [--threads 1] [--batches 1 8 32] [--prompt 64] [--tokens 64] [--reps 3]

Same workload as scripts/bench_vs_vllm.py (fresh seeded TinyStories prompts per run, each generating exactly `tokens`
tokens, all submitted at t = 0); the best run of each counts. Also checks both produce the same tokens.
"""

from __future__ import annotations

import argparse

import torch
from bench_vs_vllm import KV_SPACE_GIB, SHARED, corpus_ids, prompts, run_ours
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_attn_patch  # noqa: F401
from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.models.pretrained import smollm2_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["stories15m", "smollm2"], default="stories15m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = SHARED / "models" / "stories15m" if args.model == "stories15m" else smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine(model, tokenizer, max_memory=KV_SPACE_GIB << 30, max_num_seqs=max(args.batches),
                    max_batch_tokens=4096, max_model_len=args.prompt + args.tokens)  # fmt: skip
    packed = engine.runner._head
    if packed is None:
        raise SystemExit("the packed lm_head does not apply here (it needs an fp32 model on the CPU with oneDNN)")
    corpus = corpus_ids(tokenizer)
    check = prompts(corpus, 4, args.prompt, seed=-2)
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    outputs = {}
    for name, head in (("packed", packed), ("plain", None)):
        engine.runner._head = head
        outputs[name] = [o.token_ids for o in engine.generate(check, greedy)]
    same = sum(a == b for a, b in zip(outputs["packed"], outputs["plain"]))
    print(f"{args.model}: greedy tokens identical for {same} / {len(check)} prompts", flush=True)
    for b in args.batches:
        tok_s = {"packed": [], "plain": []}
        for rep in range(args.reps):  # interleaved, the order alternating
            batch = prompts(corpus, b, args.prompt, seed=1000 * b + rep)
            for name in ("packed", "plain") if rep % 2 == 0 else ("plain", "packed"):
                engine.runner._head = packed if name == "packed" else None
                run = run_ours(engine, batch, args.tokens)
                tok_s[name].append(run["tokens"] / run["wall_s"])
        p, q = max(tok_s["packed"]), max(tok_s["plain"])
        print(f"{args.model} batch {b:>2}: packed lm_head {p:7.1f} tok/s, plain {q:7.1f} tok/s, {p / q:.2f}x",
              flush=True)  # fmt: skip
    engine.runner._head = packed


if __name__ == "__main__":
    main()
