"""Our Engine vs vLLM's CPU build on the same model, threads and requests, measured in one process.

    flock /tmp/hfap-bench.lock .venv/bin/python scripts/bench_vs_vllm.py [--model stories15m|smollm2|both]
        [--dtypes float32 bfloat16] [--threads 1 2] [--batches 1 8 32] [--prompt 64] [--tokens 64] [--reps 2]

vLLM runs in its own venv (build/vllm-venv: scripts/vllm_env.sh) as a child process that loads the model once and
then answers batches on stdin (scripts/vllm_run.py --bench), so the two engines' runs interleave here: for each
batch size, `reps` times, ours and vLLM's in alternating order; the best of each counts. Workload: B prompts of
`prompt` tokens cut from TinyStories (seeded, fresh for every run, the same for both engines: no prefix-cache hits),
each generating exactly `tokens` tokens (greedy, EOS ignored), all submitted at t = 0 (offline). Both in the same
dtype (each of --dtypes: fp32, and bf16 where the CPU has oneDNN's bf16 kernels) on the CPU, with the same thread
count (each of --threads) on the same cores (vLLM: VLLM_CPU_OMP_THREADS_BIND, ours: torch threads and this
process's CPU affinity) and the same step token budget
(vLLM's max_num_batched_tokens, 4096 for its offline LLM on a CPU). One vLLM process per (model, dtype, threads).
vLLM runs as it does by default (compiled); ours runs every linear layer on packed oneDNN weights (FastLinear,
models/fast_linear.py: the run fails if that path did not run).
Reports generated tokens / s per batch size, median time to first token (from submission) and inter-token latency
(per request: (last - first token time) / (tokens - 1)), KV-cache bytes per token, and the ratios ours / vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_attn_patch  # noqa: F401
from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.models import fast_linear
from hf_attn_patch.models.pretrained import smollm2_dir

import benchlib

VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", benchlib.ROOT / "build" / "vllm-venv" / "bin" / "python"))
KV_SPACE_GIB = 1  # vLLM's KV pool (VLLM_CPU_KVCACHE_SPACE); ours gets the same bytes


def corpus_ids(tokenizer) -> list[int]:
    return tokenizer(benchlib.corpus("tinystories_sample")[:200_000]).input_ids


def prompts(ids: list[int], n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n windows of `length` tokens of the corpus at seeded random starts."""
    rng = random.Random(seed)
    return [ids[s : s + length] for s in (rng.randrange(0, len(ids) - length) for _ in range(n))]


def run_ours(engine: Engine, batch: list[list[int]], tokens: int) -> dict:
    """All requests at t = 0; TTFT and mean inter-token gap per request from the step clock."""
    start = time.perf_counter()
    first, last, ids = {}, {}, {}
    for prompt in batch:
        ids[engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))] = len(ids)
    while engine.has_unfinished():
        for out in engine.step():
            t = time.perf_counter() - start
            first.setdefault(out.request_id, t)
            last[out.request_id] = t
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "tokens": tokens * len(batch),
        "ttft_s": list(first.values()),
        "itl_s": [(last[r] - first[r]) / max(1, tokens - 1) for r in first],
    }


class VLLMChild:
    """scripts/vllm_run.py --bench in vLLM's venv: one load, then one batch per line."""

    def __init__(self, model_dir: Path, threads: int, max_seqs: int, max_len: int, dtype: str = "float32"):
        engine = {
            "dtype": dtype,
            "skip_tokenizer_init": True,
            "max_model_len": max_len,
            "seed": 0,
            "max_num_seqs": max_seqs,
        }
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB),
            "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        }
        self.proc = subprocess.Popen(
            [
                str(VLLM_PYTHON),
                str(benchlib.ROOT / "scripts" / "vllm_run.py"),
                "--bench",
                str(model_dir),
                json.dumps(engine),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pool = json.loads(self._read("READY "))

    def _read(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise RuntimeError(f"vLLM exited (code {self.proc.wait()}) before {prefix.strip()}")

    def run(self, batch: list[list[int]], tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": batch, "max_tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def best(runs: list[dict]) -> dict:
    r = min(runs, key=lambda r: r["wall_s"])
    return {
        "tok/s": r["tokens"] / r["wall_s"],
        "ttft_ms": 1000 * statistics.median(r["ttft_s"]),
        "itl_ms": 1000 * statistics.median(r["itl_s"]),
    }


def bench(label: str, model_dir: Path, args, dtype: str, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, range(threads))  # the cores vLLM's threads are bound to (VLLM_CPU_OMP_THREADS_BIND)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    max_len, corpus = args.prompt + args.tokens, corpus_ids(tokenizer)
    label = f"{label} {dtype} {threads}t"
    print(f"{label}: starting vLLM (one load, about a minute)", flush=True)
    vllm = VLLMChild(model_dir, threads, max(args.batches), max_len, dtype)
    engine = Engine(
        model,
        tokenizer,
        max_memory=KV_SPACE_GIB << 30,
        max_num_seqs=max(args.batches),
        max_batch_tokens=vllm.pool["max_num_batched_tokens"],
        max_model_len=max_len,
    )  # vLLM's step budget
    ours_kv = engine.block_bytes / engine.kv.block_size
    vllm_kv = (KV_SPACE_GIB << 30) / (vllm.pool["num_blocks"] * vllm.pool["block_size"])
    try:
        warm = prompts(corpus, max(args.batches), args.prompt, seed=-1)  # first-call costs out of the timings
        fast_linear.reset_counts()
        run_ours(engine, warm, 8), vllm.run(warm, 8)
        if not set(fast_linear.counts()) <= set(fast_linear.FAST):  # the fast path must have run, and only it
            raise SystemExit(f"{label}: our linear layers did not all run packed: {fast_linear.counts()}")
        rows = []
        for b in args.batches:
            ours, theirs = [], []
            for rep in range(args.reps):  # interleaved, the order alternating: load drift hits both
                batch = prompts(corpus, b, args.prompt, seed=1000 * b + rep)  # fresh: no prefix-cache hits
                first, second = (ours, theirs) if rep % 2 == 0 else (theirs, ours)
                for runs in (first, second):
                    runs.append(run_ours(engine, batch, args.tokens) if runs is ours else vllm.run(batch, args.tokens))
            o, v = best(ours), best(theirs)
            rows.append({"model": label, "batch": b, "ours": o, "vllm": v, "kv_bytes_per_token": (ours_kv, vllm_kv)})
            print(
                f"{label} batch {b:>2}: ours {o['tok/s']:7.1f} tok/s  vLLM {v['tok/s']:7.1f} tok/s  "
                f"ratio {o['tok/s'] / v['tok/s']:.2f}x | TTFT ms {o['ttft_ms']:.0f} vs {v['ttft_ms']:.0f} | "
                f"ITL ms {o['itl_ms']:.1f} vs {v['itl_ms']:.1f}",
                flush=True,
            )
    finally:
        vllm.close()
    print(f"{label}: KV bytes per token ours {ours_kv:.0f}, vLLM {vllm_kv:.0f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["stories15m", "smollm2", "both"], default="stories15m")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"{VLLM_PYTHON} is missing: bash scripts/vllm_env.sh builds vLLM's venv")
    models = {"stories15m": benchlib.model_dir("stories15m"), "smollm2": None}
    names = ["stories15m", "smollm2"] if args.model == "both" else [args.model]
    rows = []
    for name in names:
        for dtype in args.dtypes:
            for threads in args.threads:
                rows += bench(name, models[name] or smollm2_dir(), args, dtype, threads)
    print(
        "\n| model | batch | ours tok/s | vLLM tok/s | ratio | TTFT ms ours / vLLM | ITL ms ours / vLLM | KV B/token |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        o, v, (ok, vk) = r["ours"], r["vllm"], r["kv_bytes_per_token"]
        print(
            f"| {r['model']} | {r['batch']} | {o['tok/s']:.1f} | {v['tok/s']:.1f} | {o['tok/s'] / v['tok/s']:.2f}x "
            f"| {o['ttft_ms']:.0f} / {v['ttft_ms']:.0f} | {o['itl_ms']:.1f} / {v['itl_ms']:.1f} "
            f"| {ok:.0f} / {vk:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
