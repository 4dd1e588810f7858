"""PagedKVCache vs transformers' DynamicCache / StaticCache, in one process: memory, decode speed, prefix caching.

    .venv/bin/python scripts/bench_cache.py [--quick] [--threads 2]

1. Memory: a ragged batch (prompt lengths 16..1024, outputs 16..256, stories260k shape at fp32) as each cache holds
   it at the end of generation: bytes held vs the ideal (tokens actually in each row x bytes per token).
   DynamicCache and StaticCache pad every row to the longest; the paged cache holds each row's own blocks.
2. Decode throughput: greedy decode steps on a prefilled DynamicCache vs PagedKVCache (its pool and the final
   length given as generate(cache_implementation="paged_kv") gives them, so the rows are laid out to be read as
   views), stories260k (batch 1 and 8,
   context 512 and 2048; it runs past its 512 trained positions, which changes no cost) and SmolLM2-135M (batch 1
   and 8 at 512, batch 1 at 2048), and batch 8 at 512 left-padded (a ragged batch: each row but the first padded
   by 0..255) for both models. --quick: stories260k at 512 only.
3. Prefix caching: time to first token of a request whose 1,024-token prefix another request already computed
   (warm) vs the same request on an empty cache (cold), SmolLM2-135M (--quick: stories260k).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, StaticCache

import hf_attn_patch  # noqa: F401
from hf_attn_patch import PagedKVCache
from hf_attn_patch.cache.generate_hook import pool_blocks_for_generation
from hf_attn_patch.compat import cache_kwarg
from hf_attn_patch.kv_memory import kv_cache_bytes
from hf_attn_patch.models import load_default, load_smollm2


def cache_bytes(cache) -> int:
    if isinstance(cache, PagedKVCache):
        return cache.stats()["allocated_bytes"]
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers if layer.keys is not None)


def memory(model, block_size: int, new_tokens: int) -> None:
    prompts = [16, 1024, 200, 64, 512, 33, 700, 128]
    torch.manual_seed(0)
    batch, width = len(prompts), max(prompts)
    ids = torch.randint(3, model.config.vocab_size, (batch, width))
    mask = torch.zeros_like(ids)
    for r, n in enumerate(prompts):
        mask[r, width - n :] = 1
    per_token = kv_cache_bytes(model.config, 1, dtype=torch.float32)
    ideal = sum(n + new_tokens for n in prompts) * per_token  # every row's own tokens, nothing else
    caches = {
        "DynamicCache": DynamicCache(config=model.config),
        "StaticCache": StaticCache(config=model.config, max_cache_len=width + new_tokens),
        "PagedKVCache": PagedKVCache(model.config, block_size=block_size),
    }
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    print(f"\n1. memory: ragged batch of {batch}, prompt lengths {prompts}, {new_tokens} new tokens each, fp32")
    print(f"   ideal (each row's tokens x {per_token} B/token): {ideal:,} B")
    for name, cache in caches.items():
        model.generate(ids, attention_mask=mask, cache=cache, **kw)
        held = cache_bytes(cache)
        print(f"   {name:<14}{held:>14,} B held   utilization {ideal / held:6.1%}   x ideal {held / ideal:5.2f}")


def decode_tps(model, batch: int, context: int, steps: int, paged: bool, rounds: int = 3, padded: bool = False):
    """Greedy decode tokens/s on a prefilled cache (prefill not timed): best of `rounds` rounds of `steps` steps,
    each round cropped back so every round decodes at the same context. padded: rows left-padded by 0..context/2
    (a ragged batch as generate() gets it; positions counted from each row's first token)."""
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, context))
    mask = torch.ones_like(ids)
    if padded:
        for row, pad in enumerate(torch.randint(0, context // 2, (batch,)).tolist()[1:], 1):  # row 0 is the longest
            mask[row, :pad] = 0
    blocks = pool_blocks_for_generation(batch, context + steps, 16)  # as generate(cache_implementation="paged_kv")
    cache = PagedKVCache(model.config, block_size=16, num_blocks=blocks) if paged else DynamicCache(config=model.config)
    if paged:
        cache.start_request(ids, mask, max_length=context + steps)  # as generate() passes its max_length
    best = float("inf")
    with torch.no_grad():
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        first = model(ids, attention_mask=mask, position_ids=positions, **cache_kwarg(cache)).logits[:, -1:].argmax(-1)
        for _ in range(rounds):
            token, step_mask = first, mask
            start = time.perf_counter()
            for _ in range(steps):
                step_mask = torch.cat((step_mask, step_mask.new_ones(batch, 1)), 1)
                position = step_mask.sum(1, keepdim=True) - 1
                token = model(token, attention_mask=step_mask, position_ids=position,
                              **cache_kwarg(cache)).logits[:, -1:].argmax(-1)  # fmt: skip
            best = min(best, time.perf_counter() - start)
            cache.crop(-steps)
    return batch * steps / best


def throughput(cases: list[tuple[str, object, int, int, bool]], steps: int) -> None:
    print(f"\n2. decode throughput: best of 3 rounds of {steps} greedy steps on a prefilled cache, tokens/s")
    print(f"   {'model':<14}{'batch':>6}{'context':>9}{'padded':>8}{'Dynamic':>10}{'paged_kv':>10}{'ratio':>8}")
    decode_tps(cases[0][1], 1, 64, 8, paged=False)  # warm-up: the first forward of a process is slow
    for name, model, batch, context, padded in cases:
        dynamic = decode_tps(model, batch, context, steps, paged=False, padded=padded)
        paged = decode_tps(model, batch, context, steps, paged=True, padded=padded)
        print(f"   {name:<14}{batch:>6}{context:>9}{'yes' if padded else 'no':>8}{dynamic:>10.1f}{paged:>10.1f}"
              f"{paged / dynamic:>7.2f}x")


def prefix_ttft(model, prefix_len: int) -> None:
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    prefix = torch.randint(3, vocab, (1, prefix_len))
    first = torch.cat((prefix, torch.randint(3, vocab, (1, 16))), 1)
    second = torch.cat((prefix, torch.randint(3, vocab, (1, 16))), 1)
    kw = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    cold, warm = [], []
    for _ in range(3):
        cache = PagedKVCache(model.config, block_size=16)
        start = time.perf_counter()
        model.generate(second, cache=cache, **kw)
        cold.append(time.perf_counter() - start)
        cache = PagedKVCache(model.config, block_size=16)
        model.generate(first, cache=cache, **kw)
        start = time.perf_counter()
        model.generate(second, cache=cache, **kw)
        warm.append(time.perf_counter() - start)
        hits = cache.stats()["prefix_hit_tokens"]
    cold_ms, warm_ms = statistics.median(cold) * 1e3, statistics.median(warm) * 1e3
    print(f"\n3. prefix caching: time to first token, {prefix_len}-token shared prefix + 16 new tokens")
    print(f"   cold {cold_ms:.1f} ms, warm {warm_ms:.1f} ms ({hits} prefix tokens reused): {cold_ms / warm_ms:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stories260k only, context 512")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, CPU")
    stories, _ = load_default()
    memory(stories, block_size=16, new_tokens=256)
    cases = [("stories260k", stories, batch, context, False) for batch in (1, 8) for context in (512, 2048)]
    cases.append(("stories260k", stories, 8, 512, True))
    if not args.quick:
        smollm2 = load_smollm2()[0]
        # batch 8 at 2048 would spend minutes in SmolLM2's prefill on 2 cores: left out
        cases += [("SmolLM2-135M", smollm2, batch, context, padded)
                  for batch, context, padded in ((1, 512, False), (8, 512, False), (1, 2048, False), (8, 512, True))]
    else:
        cases = [c for c in cases if c[3] == 512]
    throughput(cases, steps=32)
    prefix_ttft(stories if args.quick else smollm2, 496 if args.quick else 1024)

if __name__ == "__main__":
    main()
