"""Decode latency of MLA: transformers' DeepseekV3Attention (re-expands K/V from the cached latent for every cached
token each step) vs our MultiHeadLatentAttention, naive path and absorbed path (DynamicCache), and absorbed over
PagedKVCache; same weights, in one process.

    .venv/bin/python scripts/bench_mla_decode.py [--contexts 1024 4096 16384] [--steps 30] [--threads 2]
        [--clock wall|thread] [--warm] [--profile N]

Model: DeepSeek-V3 layout, 2 layers, hidden 512, 8 heads, kv_lora_rank 128, rope 32, nope 64, v 64 (RESEARCH.md's
configuration), fp32 on CPU, batch 1. Each cache is prefilled once, in chunks of 512 tokens (our model with
absorb="auto", which expands K/V for such chunks). Then every round decodes one token with each column in turn and
crops the cache back, so every step sees the same context and a change in the machine's load hits all columns alike.
Prints ms per decoded token (median over rounds) and the speed-up of the faster absorbed column over stock: the
median of the per-round ratios, with their interquartile range. `--clock thread` (with `--threads 1`) times the CPU
time of the one thread that runs every op instead of the wall clock: on a machine shared with other work, the time
spent waiting for a core drops out. `--warm` runs an untimed step of the same column right before each timed one, so
each column is timed in steady state, its weights in cache as in a real decode loop (without it, each step follows
another column's, which has evicted them; that costs the smaller absorbed model more). `--profile N` then profiles
10 more steps of every column (torch.profiler) and prints each one's N costliest ops per step (self CPU time, calls,
input shapes): what one column runs that another does not.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_attn_patch
from hf_attn_patch import PagedKVCache
from hf_attn_patch.attention import MultiHeadLatentAttention
from hf_attn_patch.compat import cache_kwarg
from hf_attn_patch.converters.targets.exact import to_variant

PREFILL_CHUNK = 512
COLUMNS = {  # column: (model, cache, absorb mode of our layers)
    "stock": ("stock", "dynamic", None),
    "ours naive": ("ours", "dynamic", "never"),
    "ours absorbed": ("ours", "dynamic", "always"),
    "absorbed+paged": ("ours", "paged", "always"),
}


def decode_rounds(models: dict, layers: list, context: int, steps: int, clock, warm: bool = False) -> dict:
    """ms per decoded token of every column, one list entry per round (two warm-up rounds dropped)."""
    torch.manual_seed(0)
    ids = torch.randint(0, models["stock"].config.vocab_size, (1, context + 1))
    caches = {}
    with torch.no_grad():
        for layer in layers:
            layer.absorb = "auto"
        for model_name, kind, _ in COLUMNS.values():
            if (model_name, kind) not in caches:
                model = models[model_name]
                cache = PagedKVCache(model.config) if kind == "paged" else DynamicCache(config=model.config)
                for start in range(0, context, PREFILL_CHUNK):  # chunks: a 16K prompt's attention fits in memory
                    model(ids[:, start : min(start + PREFILL_CHUNK, context)], **cache_kwarg(cache))
                caches[model_name, kind] = cache
        times = {column: [] for column in COLUMNS}
        for step in range(steps + 2):
            for column, (model_name, kind, absorb) in COLUMNS.items():
                for layer in layers if absorb else ():
                    layer.absorb = absorb
                cache = caches[model_name, kind]
                if warm:  # an untimed step of this column first: its weights in cache, as in a decode loop
                    models[model_name](ids[:, context:], **cache_kwarg(cache))
                    cache.crop(-1)
                start = clock()
                models[model_name](ids[:, context:], **cache_kwarg(cache))
                elapsed = clock() - start
                cache.crop(-1)  # drop the decoded token: every step sees the same context
                if step >= 2:
                    times[column].append(elapsed * 1e3)
    return times


def profile_columns(models: dict, layers: list, context: int, top: int) -> None:
    """Print, per column, the `top` ops by self CPU time per decoded token (10 steps on the caches of a fresh
    prefill), with calls per step and input shapes."""
    from torch.profiler import ProfilerActivity, profile

    steps = 10
    caches = {}
    with torch.no_grad():
        ids = torch.randint(0, models["stock"].config.vocab_size, (1, context + 1))
        for column, (model_name, kind, absorb) in COLUMNS.items():
            for layer in layers:
                layer.absorb = absorb or "auto"
            model = models[model_name]
            if (model_name, kind) not in caches:
                cache = PagedKVCache(model.config) if kind == "paged" else DynamicCache(config=model.config)
                for start in range(0, context, PREFILL_CHUNK):
                    model(ids[:, start : min(start + PREFILL_CHUNK, context)], **cache_kwarg(cache))
                caches[model_name, kind] = cache
            cache = caches[model_name, kind]
            for _ in range(2):  # warm-up
                model(ids[:, context:], **cache_kwarg(cache))
                cache.crop(-1)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(steps):
                    model(ids[:, context:], **cache_kwarg(cache))
                    cache.crop(-1)
            events = prof.key_averages(group_by_input_shape=True)
            total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
            print(f"\n{column} at {context}: {total:.2f} ms self CPU per token (profiled, crop included)")
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
                print(f"  {e.self_cpu_time_total / steps / 1e3:8.3f} ms {e.count / steps:6.1f}x  {e.key:<36} "
                      f"{str(e.input_shapes)[:70]}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=30, help="measured rounds per context (after 2 warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: CPU time of the calling thread (needs --threads 1)")
    parser.add_argument("--warm", action="store_true",
                        help="time each column after an untimed step of its own (steady state, weights in cache)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, print the N costliest ops per token of every column (torch.profiler)")
    args = parser.parse_args()
    if args.profile < 0:
        parser.error(f"--profile must be >= 0, got {args.profile}")
    for name in ("steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.contexts) < 1:
        parser.error(f"--contexts must be >= 1, got {min(args.contexts)}")
    if args.clock == "thread" and args.threads != 1:
        parser.error(f"--clock thread times one thread: it needs --threads 1, got --threads {args.threads}")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=max(8192, max(args.contexts) + 1),
    )  # fmt: skip
    with hf_attn_patch.unpatched():  # transformers' own DeepseekV3Attention
        stock = AutoModelForCausalLM.from_config(config).eval()
    ours = to_variant(stock, "mla")
    layers = [m for m in ours.modules() if isinstance(m, MultiHeadLatentAttention)]
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, batch 1, {args.clock} clock, ms per decoded token "
          f"(median of {args.steps} rounds{', each after a warm-up step' if args.warm else ''})")  # fmt: skip
    print(f"{'context':>8}" + "".join(f"{column:>16}" for column in COLUMNS) + f"{'x stock':>9}{'(IQR)':>14}")
    for context in args.contexts:
        times = decode_rounds({"stock": stock, "ours": ours}, layers, context, args.steps, clock, args.warm)
        ratios = sorted(
            s / min(a, p) for s, a, p in zip(times["stock"], times["ours absorbed"], times["absorbed+paged"])
        )
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(
            f"{context:>8}" + "".join(f"{statistics.median(times[column]):>16.2f}" for column in COLUMNS)
            + f"{median:>8.1f}x{f'({q1:.1f}-{q3:.1f})':>14}", flush=True,
        )  # fmt: skip
    for context in args.contexts if args.profile else ():
        profile_columns({"stock": stock, "ours": ours}, layers, context, args.profile)


if __name__ == "__main__":
    main()
