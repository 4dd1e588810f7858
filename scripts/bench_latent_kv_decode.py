"""Decode cost of latent K/V attention (keys rebuilt from the cached latent and rotated every step) against the
source's GQA cache and absorbed MLA at the same KV bytes, in one process.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_latent_kv_decode.py [--contexts 1024 4096 16384] [--steps 20]
        [--threads 1] [--layers 4]

Model: SmolLM2-135M's attention shape (hidden 576, 9 heads, 3 KV heads of 64, MLP 1536), --layers layers, random
weights (the cost does not depend on them), fp32, batch 1. Columns, each over DynamicCache and PagedKVCache:
    gqa        the source form: 2 x 3 x 64 = 384 cached values per token per layer
    latent_kv  keys latent 64 + values latent 128 = 192 values (50%), keys rebuilt in blocks of KEY_BLOCK tokens
    mla        kv_lora_rank 128 + RoPE key 64 = 192 values (50%), absorbed decode
Each cache is prefilled once in chunks of 512 tokens; every round decodes one token with each column in turn and
crops the cache back, so every step sees the same context and load changes hit all columns alike. Prints the median
ms per decoded token and latent_kv's cost relative to gqa and mla (median of per-round ratios), plus the largest
transient a latent_kv decode step allocates for keys (KEY_BLOCK x 3 x 64 fp32 per row) against the whole GQA K cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_attn_patch
from hf_attn_patch import PagedKVCache
from hf_attn_patch.attention import latent_kv
from hf_attn_patch.compat import cache_kwarg

CHUNK = 512
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             vocab_size=49152, max_position_embeddings=32768)  # fmt: skip
VARIANTS = {
    "gqa": {},
    "latent_kv": dict(attention_variant="latent_kv", latent_key_rank=64, latent_value_rank=128),
    "mla": dict(attention_variant="mla", kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                num_key_value_heads=9),
}  # fmt: skip


def build(layers: int) -> dict:
    models = {}
    for name, fields in VARIANTS.items():
        torch.manual_seed(0)
        config = LlamaConfig(num_hidden_layers=layers, **{**SHAPE, **fields})
        models[name] = LlamaForCausalLM(config).eval()
    return models


@torch.no_grad()
def rounds(models: dict, context: int, steps: int) -> dict[str, list[float]]:
    ids = torch.randint(0, SHAPE["vocab_size"], (1, context + 1))
    caches = {}
    for name, model in models.items():
        for kind in ("dynamic", "paged"):
            cache = PagedKVCache(model.config) if kind == "paged" else DynamicCache(config=model.config)
            for start in range(0, context, CHUNK):
                model(ids[:, start : min(start + CHUNK, context)], **cache_kwarg(cache))
            caches[name, kind] = cache
    times = {key: [] for key in caches}
    for step in range(steps + 2):
        for (name, kind), cache in caches.items():
            started = time.perf_counter()
            models[name](ids[:, context:], **cache_kwarg(cache))
            elapsed = (time.perf_counter() - started) * 1e3
            cache.crop(-1)  # drop the decoded token: every step sees the same context
            if step >= 2:  # two warm-up rounds
                times[name, kind].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert hf_attn_patch.is_patched()
    models = build(args.layers)
    print(f"{args.layers} layers, fp32, {args.threads} thread(s), median ms per decoded token ({args.steps} rounds)")
    print("| context | gqa | gqa paged | latent_kv | latent_kv paged | mla | mla paged | latent_kv / gqa | "
          "latent_kv / mla |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        t = rounds(models, context, args.steps)
        med = {k: statistics.median(v) for k, v in t.items()}
        best = {n: min(("dynamic", "paged"), key=lambda kind: med[n, kind]) for n in VARIANTS}
        ratio = {other: statistics.median(a / b for a, b in zip(t["latent_kv", best["latent_kv"]], t[other, best[other]]))
                 for other in ("gqa", "mla")}  # fmt: skip
        cells = " | ".join(f"{med[n, k]:.2f}" for n in VARIANTS for k in ("dynamic", "paged"))
        print(f"| {context} | {cells} | {ratio['gqa']:.2f}x | {ratio['mla']:.2f}x |", flush=True)
    block = min(latent_kv.KEY_BLOCK, max(args.contexts)) * 3 * 64 * 4
    full = max(args.contexts) * 3 * 64 * 4 * args.layers
    print(f"latent_kv decode transient for keys: {block / 2**20:.2f} MiB per row (KEY_BLOCK={latent_kv.KEY_BLOCK}); "
          f"the GQA K cache at {max(args.contexts)} tokens: {full / 2**20:.1f} MiB ({args.layers} layers)")


if __name__ == "__main__":
    main()
