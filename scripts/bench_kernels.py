"""Benchmark the kernels against the pure-torch reference (and flash-attn when installed), in one process.

    python scripts/bench_kernels.py --out results.md          # CUDA: the GPU grid (fp16/bf16, context 1K..32K,
                                                              #   batch 1..64), microseconds and % of peak bandwidth
    python scripts/bench_kernels.py --cpu-smoke               # CPU: torch reference only, tiny sizes (a check that
                                                              #   the script runs; its figures mean nothing for GPUs)

Paged decode uses Llama-3-8B's attention shape (32 query heads, 8 KV heads, head dim 128) over PagedKVCache's combined
K|V storage; MLA decode DeepSeek-V3's (128 heads, latent 512 + rope 64). Every row holds `context` tokens.
bytes = K/V (latent) bytes read + query + output bytes; bandwidth = bytes / time, shown as % of --peak-tbs (H200:
4.8 TB/s). GPU timing: CUDA events around each call, L2 flushed before each (a 256 MiB write), median of the calls
after warmup.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import torch

from hf_attn_patch.kernels import ops as kernels
from hf_attn_patch.kernels import reference

GQA_SHAPE = dict(heads_q=32, heads_kv=8, head_dim=128)  # Llama-3-8B
MLA_SHAPE = dict(heads=128, d_c=512, d_r=64, scale=192**-0.5)  # DeepSeek-V3 (scale: 1/sqrt(nope 128 + rope 64))


def timer(device: str, warmup: int, iters: int):
    """-> measure(fn) giving the median microseconds of one call."""
    if device == "cuda":
        flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

        def measure(fn):
            for _ in range(warmup):
                fn()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            for start, end in zip(starts, ends):
                flush.zero_()  # cold L2: decode reads its KV from HBM, as it does in a model
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

        return measure

    def measure(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e6 * statistics.median(times)

    return measure


def paged(batch: int, context: int, block_size: int, heads: int, width: int, dtype, device):
    """Storage [slots, heads, width] with every row's blocks shuffled over the pool; block tables; context lens."""
    per_row = -(-context // block_size)
    num_blocks = batch * per_row + 1  # + the null block
    storage = torch.randn(num_blocks * block_size, heads, width, device=device, dtype=dtype)
    order = torch.randperm(num_blocks - 1, device=device) + 1
    tables = order.view(batch, per_row).to(torch.int32)
    return storage, tables, torch.full((batch,), context, dtype=torch.int32, device=device)


def bench_decode(measure, batch, context, dtype, device, backends, block_size, ref_max_tokens):
    h_q, h_kv, d = GQA_SHAPE["heads_q"], GQA_SHAPE["heads_kv"], GQA_SHAPE["head_dim"]
    element = torch.finfo(dtype).bits // 8
    useful = batch * context * h_kv * 2 * d * element + 2 * batch * h_q * d * element
    query = torch.randn(batch, h_q, d, device=device, dtype=dtype)
    row = {}
    for name in backends:
        if name == "torch" and batch * context > ref_max_tokens:
            continue
        bs = 256 if name == "flash_attn" else block_size
        storage, tables, lens = paged(batch, context, bs, h_kv, 2 * d, dtype, device)
        if name == "triton (slots)":  # the same pages read through a per-token slot table (block_size 1)
            tables, bs = reference.token_slots(tables, bs, context), 1
        args = (query, storage[..., :d], storage[..., d:], tables, lens)
        backend = "triton" if name.startswith("triton") else name
        fn = lambda: kernels.paged_decode_attention(*args, block_size=bs, backend=backend, validate=False)  # noqa
        row[name] = measure(fn)
        del storage, tables, args
    return useful, row


def bench_mla(measure, batch, context, dtype, device, backends, block_size, ref_max_tokens):
    h, d_c, d_r = MLA_SHAPE["heads"], MLA_SHAPE["d_c"], MLA_SHAPE["d_r"]
    element = torch.finfo(dtype).bits // 8
    useful = batch * context * (d_c + d_r) * element + batch * h * (2 * d_c + d_r) * element
    q_latent = torch.randn(batch, h, d_c, device=device, dtype=dtype)
    q_rope = torch.randn(batch, h, d_r, device=device, dtype=dtype)
    storage, tables, lens = paged(batch, context, block_size, 1, d_c + d_r, dtype, device)
    row = {}
    for name in backends:
        if name == "torch" and batch * context > ref_max_tokens:
            continue
        fn = lambda: kernels.mla_decode(q_latent, q_rope, storage, tables, lens, block_size=block_size,  # noqa
                                        scale=MLA_SHAPE["scale"], backend=name, validate=False)  # fmt: skip
        row[name] = measure(fn)
    return useful, row


def table(title, columns, rows, peak_tbs, show_peak):
    lines = [f"### {title}", "", "| dtype | batch | context | MB read | " + " | ".join(
        f"{c} us" + (" (% peak)" if show_peak else " (GB/s)") for c in columns) + " |"]  # fmt: skip
    lines.append("|" + "---|" * 4 + "---:|" * len(columns))
    for (dtype, batch, context, useful), times in rows:
        cells = []
        for c in columns:
            if c not in times:
                cells.append("-")
                continue
            rate = useful / (times[c] * 1e-6)  # bytes / s
            extra = f"{100 * rate / (peak_tbs * 1e12):.0f}%" if show_peak else f"{rate / 1e9:.1f}"
            cells.append(f"{times[c]:.1f} ({extra})")
        lines.append(f"| {dtype} | {batch} | {context} | {useful / 1e6:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, torch reference only, tiny sizes")
    parser.add_argument("--out", help="also write the markdown tables to this file")
    parser.add_argument("--contexts", default="1024,4096,16384,32768")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--block-size", type=int, default=16, help="PagedKVCache's default")
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="peak HBM bandwidth, TB/s (H200: 4.8)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--ref-max-tokens", type=int, default=2**21, help="skip the torch reference above B*L")
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        device, contexts, batches, dtypes = "cpu", [64, 257], [1, 4], [torch.float32, torch.bfloat16]
        decode_backends, mla_backends, warmup, iters = ["torch"], ["torch"], 1, 3
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --cpu-smoke on CPU")
        device, warmup, iters = "cuda", 3, args.iters
        contexts = [int(c) for c in args.contexts.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
        dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
        decode_backends = ["triton", "triton (slots)", "torch"]
        if kernels.available_backends()["flash_attn"]:
            decode_backends.insert(2, "flash_attn")
        mla_backends = ["triton", "torch"]
    measure = timer(device, warmup, iters)
    torch.manual_seed(0)

    decode_rows, mla_rows = [], []
    for dtype in dtypes:
        for batch in batches:
            for context in contexts:
                name = str(dtype).removeprefix("torch.")
                useful, times = bench_decode(measure, batch, context, dtype, device, decode_backends,
                                             args.block_size, args.ref_max_tokens)  # fmt: skip
                decode_rows.append(((name, batch, context, useful), times))
                useful, times = bench_mla(measure, batch, context, dtype, device, mla_backends, args.block_size,
                                          args.ref_max_tokens)  # fmt: skip
                mla_rows.append(((name, batch, context, useful), times))
                print(f"{name} batch {batch} context {context}: decode {decode_rows[-1][1]}, mla {times}",
                      flush=True)  # fmt: skip

    bitmask = ""
    if device == "cuda":  # 64 rows of a 128K vocabulary (Llama-3), fp32 logits
        logits = torch.randn(64, 128_256, device=device)
        mask = torch.randint(-(2**31), 2**31 - 1, (64, -(-128_256 // 32)), dtype=torch.int32, device=device)
        useful = logits.numel() * 4 + mask.numel() * 4
        times = {b: measure(lambda b=b: kernels.apply_token_bitmask(logits, mask, backend=b)) for b in ("triton", "torch")}
        bitmask = table("Token bitmask apply (64 x 128256 fp32 logits; bytes = logits + bitmask once)",
                        ["triton", "torch"], [(("float32", 64, "-", useful), times)], args.peak_tbs, True)  # fmt: skip

    show_peak = device == "cuda"
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    versions = f"torch {torch.__version__}"
    for module in ("triton", "flash_attn"):
        try:
            versions += f", {module} {__import__(module).__version__}"
        except ImportError:
            pass
    header = (f"## Kernels ({datetime.date.today()}, {name}, {versions})\n\n"
              f"`python scripts/bench_kernels.py {' '.join(sys.argv[1:] if argv is None else argv)}`; median us per "
              f"call; {'% of ' + str(args.peak_tbs) + ' TB/s peak' if show_peak else 'GB/s'} in parentheses; "
              f"block_size {args.block_size} (flash_attn: 256; 'triton (slots)': a per-token slot table, as the "
              f"paged_kv attention function passes it); '-': not run (reference above --ref-max-tokens).\n\n")  # fmt: skip
    text = header + table("Paged decode (32 q heads, 8 KV heads, d 128)", decode_backends, decode_rows,
                          args.peak_tbs, show_peak) + "\n"  # fmt: skip
    text += table("MLA decode (128 heads, latent 512 + rope 64)", mla_backends, mla_rows, args.peak_tbs,
                  show_peak) + ("\n" + bitmask if bitmask else "")  # fmt: skip
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
