"""Packed CPU linear layers (models/fast_linear.py) against torch's F.linear, in one process, interleaved.

    flock /tmp/hfap-bench.lock .venv/bin/python scripts/bench_fast_linear.py [--part linear forward]
        [--model smollm2|stories15m] [--threads 1 2] [--dtypes float32 bfloat16] [--batches 1 4] [--reps 15]

--part linear: one product x W^T for each weight shape of SmolLM2-135M (q / o 576 x 576, k / v 192 x 576, gate / up
1,536 x 576, down 576 x 1,536, LM head 49,152 x 576) with M = 1 / 3 / 5 / 8 / 32 rows, per dtype: F.linear and the
packed oneDNN product (kernels/cpu_linear.py), median ms of `reps` interleaved calls.
--part forward: the cost of a multi-token forward (speculative verification, chunked prefill): the whole model on a
200-token DynamicCache, n = 1 / 3 / 5 / 8 new tokens per row, batch 1 and 4, with FastLinear ("ours") and with it
switched off (stock nn.Linear), interleaved, median ms of `reps`; "n/1" is the cost of an n-token forward over a
1-token one. Also prints the largest logit difference between the two.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

import hf_attn_patch  # noqa: F401
from hf_attn_patch.kernels.cpu_linear import onednn_linear_unsupported, pack_linear_weight, packed_linear
from hf_attn_patch.models import fast_linear
from hf_attn_patch.models.pretrained import smollm2_dir

from bench_vs_vllm import SHARED

SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each callable, the calls interleaved (one each per round) after one untimed call each."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def part_linear(args) -> None:
    rows_list = (1, 3, 5, 8, 32)
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n### One product, {threads} thread(s): median ms, F.linear / packed (packed speed-up)\n")
        print("| weight | dtype | " + " | ".join(f"M={m}" for m in rows_list) + " |")
        print("|---|---|" + "---:|" * len(rows_list))
        for label, (n, k) in SHAPES.items():
            for dname in args.dtypes:
                dtype = DTYPES[dname]
                if onednn_linear_unsupported(dtype):
                    print(f"| {label} | {dname} | skipped: {onednn_linear_unsupported(dtype)} |")
                    continue
                torch.manual_seed(0)
                weight = (torch.randn(n, k) / k**0.5).to(dtype)
                packed = pack_linear_weight(weight)
                cells = []
                for m in rows_list:
                    x = torch.randn(m, k).to(dtype)
                    t = interleaved({"plain": lambda: F.linear(x, weight), "packed": lambda: packed_linear(x, packed, None)},
                                    args.reps if n < 10_000 else max(5, args.reps // 3))  # fmt: skip
                    cells.append(f"{t['plain'] * 1e3:.3f} / {t['packed'] * 1e3:.3f} ({t['plain'] / t['packed']:.2f}x)")
                print(f"| {label} | {dname} | " + " | ".join(cells) + " |", flush=True)


@torch.no_grad()
def part_forward(args) -> None:
    model_dir = smollm2_dir() if args.model == "smollm2" else SHARED / "models" / "stories15m"
    context, counts = 200, (1, 3, 5, 8)
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if not fast_linear.installed(model):
            raise SystemExit("FastLinear is not installed (HF_ATTN_PATCH_FAST_LINEAR=0?)")
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"\n### {args.model} {dname}, {threads} thread(s): a forward of n tokens per row on a {context}-token "
                  f"cache, median ms of {args.reps}, stock / ours (n/1 cost: stock, ours)\n")  # fmt: skip
            print("| batch | " + " | ".join(f"n={n}" for n in counts) + " | ours vs stock at n=1 / n=5 | max logit diff |")
            print("|---|" + "---:|" * len(counts) + "---:|---:|")
            for batch in args.batches:
                torch.manual_seed(batch)
                ids = torch.randint(0, model.config.vocab_size, (batch, context + max(counts)))
                cache = model(ids[:, :context], use_cache=True).past_key_values

                def forward(n, on):
                    fast_linear.set_enabled(on)
                    try:
                        return model(ids[:, context : context + n], past_key_values=cache).logits
                    finally:
                        cache.crop(-n)  # back to `context` columns
                        fast_linear.set_enabled(True)

                diff = (forward(5, True).float() - forward(5, False).float()).abs().max().item()
                fast_linear.reset_counts()
                forward(1, True)
                if fast_linear.counts().get(fast_linear.PACKED, 0) == 0:
                    raise SystemExit(f"the packed path did not run: {fast_linear.counts()}")
                fns = {(n, on): (lambda n=n, on=on: forward(n, on)) for n in counts for on in (False, True)}
                t = interleaved(fns, args.reps)
                cells = [f"{t[n, False] * 1e3:.1f} / {t[n, True] * 1e3:.1f} ({t[n, False] / t[1, False]:.2f}x, "
                         f"{t[n, True] / t[1, True]:.2f}x)" for n in counts]  # fmt: skip
                print(f"| {batch} | " + " | ".join(cells) + f" | {t[1, False] / t[1, True]:.2f}x / "
                      f"{t[5, False] / t[5, True]:.2f}x | {diff:.1e} |", flush=True)  # fmt: skip
        del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", nargs="+", choices=["linear", "forward"], default=["linear", "forward"])
    parser.add_argument("--model", choices=["smollm2", "stories15m"], default="smollm2")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, oneDNN bf16: {onednn_linear_unsupported(torch.bfloat16) or 'yes'}")
    if "linear" in args.part:
        part_linear(args)
    if "forward" in args.part:
        part_forward(args)


if __name__ == "__main__":
    main()
