"""Why the "paged_kv" reference attention gathers then runs SDPA instead of flex_attention, on CPU.

    .venv/bin/python scripts/bench_flex_attention.py

Decode attention (one query per row) over gathered K/V, stories260k-like heads (8 query heads, 4 KV heads,
head_dim 8), fp32, 2 threads: SDPA vs torch's flex_attention without torch.compile (its CPU fallback materializes
the full score matrix). Prints microseconds per call and the ratio.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention


def per_call_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, 2 threads, fp32; us per decode attention call")
    print(f"{'batch':>6}{'context':>9}{'sdpa':>10}{'flex':>12}{'flex / sdpa':>13}")
    for batch, context in ((1, 512), (8, 512), (8, 2048)):
        q = torch.randn(batch, 8, 1, 8)
        k, v = torch.randn(batch, 4, context, 8), torch.randn(batch, 4, context, 8)
        sdpa = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 200)
        flex = per_call_us(lambda: flex_attention(q, k, v, enable_gqa=True), 10)
        print(f"{batch:>6}{context:>9}{sdpa:>10.1f}{flex:>12.1f}{flex / sdpa:>12.1f}x")


if __name__ == "__main__":
    main()
