"""Decode latency of MLA: transformers' DeepseekV3Attention (re-expands K/V for every cached token each step) vs
our MultiHeadLatentAttention, naive path and absorbed path (DynamicCache), and absorbed over PagedKVCache; same
weights, in one process.

    .venv/bin/python scripts/bench_mla_decode.py [--contexts 256 1024 4096] [--steps 20] [--threads 2]

Model: DeepSeek-V3 layout, 2 layers, hidden 512, 8 heads, kv_lora_rank 128, rope 32, nope 64, v 64 (RESEARCH.md's
configuration), fp32 on CPU, batch 1. Each step decodes one token on a prefilled cache, then crops the cache back,
so every step sees the same context. Prints ms per decoded token (median of steps) and speed-ups.
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
from hf_attn_patch.converters.exact import to_variant


def decode_ms(model, context: int, steps: int, paged: bool = False) -> float:
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1))
    cache = PagedKVCache(model.config) if paged else DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :context], past_key_values=cache)
        times = []
        for _ in range(steps + 2):
            start = time.perf_counter()
            model(ids[:, context:], past_key_values=cache)
            times.append(time.perf_counter() - start)
            cache.crop(-1)  # drop the decoded token: every step sees the same context
    return statistics.median(times[2:]) * 1e3  # first two steps are warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=8192,
    )  # fmt: skip
    with hf_attn_patch.unpatched():  # transformers' own DeepseekV3Attention
        stock = AutoModelForCausalLM.from_config(config).eval()
    ours = to_variant(stock, "mla")
    layers = [m for m in ours.modules() if isinstance(m, MultiHeadLatentAttention)]
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, batch 1, ms per decoded token (median)")
    print(f"{'context':>8}{'stock':>10}{'ours naive':>12}{'ours absorbed':>15}{'absorbed+paged':>16}{'x stock':>9}")
    for context in args.contexts:
        results = {"stock": decode_ms(stock, context, args.steps)}
        for mode in ("never", "always"):
            for layer in layers:
                layer.absorb = mode
            results[mode] = decode_ms(ours, context, args.steps)
        results["paged"] = decode_ms(ours, context, args.steps, paged=True)
        best = min(results["always"], results["paged"])
        print(
            f"{context:>8}{results['stock']:>10.2f}{results['never']:>12.2f}{results['always']:>15.2f}"
            f"{results['paged']:>16.2f}{results['stock'] / best:>8.1f}x"
        )


if __name__ == "__main__":
    main()
