"""Kernels: attention decode, linear layers and masks, ours against the stock or reference path, one process.

    .venv/bin/python scripts/bench_kernels.py PART [options]     # PART --help: its options

Parts:
    gpu               paged and MLA decode kernels (Triton, flash_attn, torch) and the token bitmask, context 1K-32K,
                      batch 1/8/64, fp16/bf16: a CUDA machine's table (scripts/gpu_check.sh runs it)
    mla-decode        absorbed MLA decode against transformers' DeepseekV3Attention, whole-model step on CPU
    latent-kv-decode  latent K/V decode against MLA and GQA at SmolLM2's shape
    fast-linear       oneDNN-packed CPU linear layers against F.linear: products and a model's forward
    flex              torch's flex_attention without torch.compile against SDPA for CPU decode
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_attn_patch
from hf_attn_patch import PagedKVCache
from hf_attn_patch.attention import MultiHeadLatentAttention, latent_kv
from hf_attn_patch.compat import cache_kwarg
from hf_attn_patch.converters.targets.exact import to_variant
from hf_attn_patch.kernels import ops as kernels
from hf_attn_patch.kernels import reference
from hf_attn_patch.kernels.cpu_linear import onednn_linear_unsupported, pack_linear_weight, packed_linear
from hf_attn_patch.models import fast_linear
from hf_attn_patch.models.pretrained import smollm2_dir

import benchlib

# ----------------------------------------------------------------------------------------------------------------- gpu
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
        fn = lambda: kernels.mla_decode(
            q_latent,
            q_rope,
            storage,
            tables,
            lens,
            block_size=block_size,  # noqa
            scale=MLA_SHAPE["scale"],
            backend=name,
            validate=False,
        )
        row[name] = measure(fn)
    return useful, row


def table(title, columns, rows, peak_tbs, show_peak):
    lines = [
        f"### {title}",
        "",
        "| dtype | batch | context | MB read | "
        + " | ".join(f"{c} us" + (" (% peak)" if show_peak else " (GB/s)") for c in columns)
        + " |",
    ]
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


def gpu_options(parser) -> None:
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, torch reference only, tiny sizes")
    parser.add_argument("--out", help="also write the markdown tables to this file")
    parser.add_argument("--contexts", default="1024,4096,16384,32768")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--block-size", type=int, default=16, help="PagedKVCache's default")
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="peak HBM bandwidth, TB/s (H200: 4.8)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--ref-max-tokens", type=int, default=2**21, help="skip the torch reference above B*L")


def gpu(args):
    """Benchmark the kernels against the pure-torch reference (and flash-attn when installed), in one process.

        python scripts/bench_kernels.py gpu --out results.md          # CUDA: the GPU grid (fp16/bf16, context 1K..32K,
                                                                  #   batch 1..64), microseconds and % of peak bandwidth
        python scripts/bench_kernels.py gpu --cpu-smoke               # CPU: torch reference only, tiny sizes (a check that
                                                                  #   the script runs; its figures mean nothing for GPUs)

    Paged decode uses Llama-3-8B's attention shape (32 query heads, 8 KV heads, head dim 128) over PagedKVCache's combined
    K|V storage; MLA decode DeepSeek-V3's (128 heads, latent 512 + rope 64). Every row holds `context` tokens.
    bytes = K/V (latent) bytes read + query + output bytes; bandwidth = bytes / time, shown as % of --peak-tbs (H200:
    4.8 TB/s). GPU timing: CUDA events around each call, L2 flushed before each (a 256 MiB write), median of the calls
    after warmup.
    """

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
                useful, times = bench_decode(
                    measure, batch, context, dtype, device, decode_backends, args.block_size, args.ref_max_tokens
                )
                decode_rows.append(((name, batch, context, useful), times))
                useful, times = bench_mla(
                    measure, batch, context, dtype, device, mla_backends, args.block_size, args.ref_max_tokens
                )
                mla_rows.append(((name, batch, context, useful), times))
                print(f"{name} batch {batch} context {context}: decode {decode_rows[-1][1]}, mla {times}", flush=True)

    bitmask = ""
    if device == "cuda":  # 64 rows of a 128K vocabulary (Llama-3), fp32 logits
        logits = torch.randn(64, 128_256, device=device)
        mask = torch.randint(-(2**31), 2**31 - 1, (64, -(-128_256 // 32)), dtype=torch.int32, device=device)
        useful = logits.numel() * 4 + mask.numel() * 4
        times = {
            b: measure(lambda b=b: kernels.apply_token_bitmask(logits, mask, backend=b)) for b in ("triton", "torch")
        }
        bitmask = table(
            "Token bitmask apply (64 x 128256 fp32 logits; bytes = logits + bitmask once)",
            ["triton", "torch"],
            [(("float32", 64, "-", useful), times)],
            args.peak_tbs,
            True,
        )

    show_peak = device == "cuda"
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    versions = f"torch {torch.__version__}"
    for module in ("triton", "flash_attn"):
        try:
            versions += f", {module} {__import__(module).__version__}"
        except ImportError:
            pass
    header = (
        f"## Kernels ({datetime.date.today()}, {name}, {versions})\n\n"
        f"`python scripts/bench_kernels.py {' '.join(sys.argv[1:])}`; median us per "
        f"call; {'% of ' + str(args.peak_tbs) + ' TB/s peak' if show_peak else 'GB/s'} in parentheses; "
        f"block_size {args.block_size} (flash_attn: 256; 'triton (slots)': a per-token slot table, as the "
        f"paged_kv attention function passes it); '-': not run (reference above --ref-max-tokens).\n\n"
    )
    text = (
        header
        + table("Paged decode (32 q heads, 8 KV heads, d 128)", decode_backends, decode_rows, args.peak_tbs, show_peak)
        + "\n"
    )
    text += table("MLA decode (128 heads, latent 512 + rope 64)", mla_backends, mla_rows, args.peak_tbs, show_peak) + (
        "\n" + bitmask if bitmask else ""
    )
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)


# ---------------------------------------------------------------------------------------------------------- mla-decode
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
                print(
                    f"  {e.self_cpu_time_total / steps / 1e3:8.3f} ms {e.count / steps:6.1f}x  {e.key:<36} "
                    f"{str(e.input_shapes)[:70]}"
                )


def mla_decode_options(parser) -> None:
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=30, help="measured rounds per context (after 2 warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: CPU time of the calling thread (needs --threads 1)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="time each column after an untimed step of its own (steady state, weights in cache)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, print the N costliest ops per token of every column (torch.profiler)",
    )


def mla_decode(args):
    """Decode latency of MLA: transformers' DeepseekV3Attention (re-expands K/V from the cached latent for every cached
    token each step) vs our MultiHeadLatentAttention, naive path and absorbed path (DynamicCache), and absorbed over
    PagedKVCache; same weights, in one process.

        .venv/bin/python scripts/bench_kernels.py mla-decode [--contexts 1024 4096 16384] [--steps 30] [--threads 2]
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
    if args.profile < 0:
        args.parser.error(f"--profile must be >= 0, got {args.profile}")
    for name in ("steps", "threads"):
        if getattr(args, name) < 1:
            args.parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.contexts) < 1:
        args.parser.error(f"--contexts must be >= 1, got {min(args.contexts)}")
    if args.clock == "thread" and args.threads != 1:
        args.parser.error(f"--clock thread times one thread: it needs --threads 1, got --threads {args.threads}")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    config = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=128,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=max(8192, max(args.contexts) + 1),
    )
    with hf_attn_patch.unpatched():  # transformers' own DeepseekV3Attention
        stock = AutoModelForCausalLM.from_config(config).eval()
    ours = to_variant(stock, "mla")
    layers = [m for m in ours.modules() if isinstance(m, MultiHeadLatentAttention)]
    print(
        f"torch {torch.__version__}, {args.threads} threads, fp32, batch 1, {args.clock} clock, ms per decoded token "
        f"(median of {args.steps} rounds{', each after a warm-up step' if args.warm else ''})"
    )
    print(f"{'context':>8}" + "".join(f"{column:>16}" for column in COLUMNS) + f"{'x stock':>9}{'(IQR)':>14}")
    for context in args.contexts:
        times = decode_rounds({"stock": stock, "ours": ours}, layers, context, args.steps, clock, args.warm)
        ratios = sorted(
            s / min(a, p) for s, a, p in zip(times["stock"], times["ours absorbed"], times["absorbed+paged"])
        )
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(
            f"{context:>8}"
            + "".join(f"{statistics.median(times[column]):>16.2f}" for column in COLUMNS)
            + f"{median:>8.1f}x{f'({q1:.1f}-{q3:.1f})':>14}",
            flush=True,
        )
    for context in args.contexts if args.profile else ():
        profile_columns({"stock": stock, "ours": ours}, layers, context, args.profile)


# ---------------------------------------------------------------------------------------------------- latent-kv-decode
CHUNK = 512
SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=32768,
)
VARIANTS = {
    "gqa": {},
    "latent_kv": dict(attention_variant="latent_kv", latent_key_rank=64, latent_value_rank=128),
    "mla": dict(
        attention_variant="mla",
        kv_lora_rank=128,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        num_key_value_heads=9,
    ),
}


def latent_build(layers: int) -> dict:
    models = {}
    for name, fields in VARIANTS.items():
        torch.manual_seed(0)
        config = LlamaConfig(num_hidden_layers=layers, **{**SHAPE, **fields})
        models[name] = LlamaForCausalLM(config).eval()
    return models


@torch.no_grad()
def latent_rounds(models: dict, context: int, steps: int) -> dict[str, list[float]]:
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
            if step >= 2:  # two warm-up latent_rounds
                times[name, kind].append(elapsed)
    return times


def latent_kv_decode_options(parser) -> None:
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)


def latent_kv_decode(args):
    """Decode cost of latent K/V attention (keys rebuilt from the cached latent and rotated every step) against the
    source's GQA cache and absorbed MLA at the same KV bytes, in one process.

        OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_kernels.py latent-kv-decode [--contexts 1024 4096 16384] [--steps 20]
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
    torch.set_num_threads(args.threads)
    assert hf_attn_patch.is_patched()
    models = latent_build(args.layers)
    print(
        f"{args.layers} layers, fp32, {args.threads} thread(s), median ms per decoded token ({args.steps} latent_rounds)"
    )
    print(
        "| context | gqa | gqa paged | latent_kv | latent_kv paged | mla | mla paged | latent_kv / gqa | "
        "latent_kv / mla |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        t = latent_rounds(models, context, args.steps)
        med = {k: statistics.median(v) for k, v in t.items()}
        best = {n: min(("dynamic", "paged"), key=lambda kind: med[n, kind]) for n in VARIANTS}
        ratio = {
            other: statistics.median(a / b for a, b in zip(t["latent_kv", best["latent_kv"]], t[other, best[other]]))
            for other in ("gqa", "mla")
        }
        cells = " | ".join(f"{med[n, k]:.2f}" for n in VARIANTS for k in ("dynamic", "paged"))
        print(f"| {context} | {cells} | {ratio['gqa']:.2f}x | {ratio['mla']:.2f}x |", flush=True)
    block = min(latent_kv.KEY_BLOCK, max(args.contexts)) * 3 * 64 * 4
    full = max(args.contexts) * 3 * 64 * 4 * args.layers
    print(
        f"latent_kv decode transient for keys: {block / 2**20:.2f} MiB per row (KEY_BLOCK={latent_kv.KEY_BLOCK}); "
        f"the GQA K cache at {max(args.contexts)} tokens: {full / 2**20:.1f} MiB ({args.layers} layers)"
    )


# --------------------------------------------------------------------------------------------------------- fast-linear
SHAPES = {
    "q/o 576x576": (576, 576),
    "k/v 192x576": (192, 576),
    "gate/up 1536x576": (1536, 576),
    "down 576x1536": (576, 1536),
    "head 49152x576": (49152, 576),
}
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
                    t = interleaved(
                        {"plain": lambda: F.linear(x, weight), "packed": lambda: packed_linear(x, packed, None)},
                        args.reps if n < 10_000 else max(5, args.reps // 3),
                    )
                    cells.append(f"{t['plain'] * 1e3:.3f} / {t['packed'] * 1e3:.3f} ({t['plain'] / t['packed']:.2f}x)")
                print(f"| {label} | {dname} | " + " | ".join(cells) + " |", flush=True)


@torch.no_grad()
def part_forward(args) -> None:
    model_dir = smollm2_dir() if args.model == "smollm2" else benchlib.SHARED / "models" / "stories15m"
    context, counts = 200, (1, 3, 5, 8)
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if not fast_linear.installed(model):
            raise SystemExit("FastLinear is not installed (HF_ATTN_PATCH_FAST_LINEAR=0?)")
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(
                f"\n### {args.model} {dname}, {threads} thread(s): a forward of n tokens per row on a {context}-token "
                f"cache, median ms of {args.reps}, stock / ours (n/1 cost: stock, ours)\n"
            )
            print(
                "| batch | " + " | ".join(f"n={n}" for n in counts) + " | ours vs stock at n=1 / n=5 | max logit diff |"
            )
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
                cells = [
                    f"{t[n, False] * 1e3:.1f} / {t[n, True] * 1e3:.1f} ({t[n, False] / t[1, False]:.2f}x, "
                    f"{t[n, True] / t[1, True]:.2f}x)"
                    for n in counts
                ]
                print(
                    f"| {batch} | " + " | ".join(cells) + f" | {t[1, False] / t[1, True]:.2f}x / "
                    f"{t[5, False] / t[5, True]:.2f}x | {diff:.1e} |",
                    flush=True,
                )
        del model


def fast_linear_bench_options(parser) -> None:
    parser.add_argument("--part", nargs="+", choices=["linear", "forward"], default=["linear", "forward"])
    parser.add_argument("--model", choices=["smollm2", "stories15m"], default="smollm2")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reps", type=int, default=15)


def fast_linear_bench(args):
    """Packed CPU linear layers (models/fast_linear.py) against torch's F.linear, in one process, interleaved.

        flock /tmp/hfap-bench.lock .venv/bin/python scripts/bench_kernels.py fast-linear [--part linear forward]
            [--model smollm2|stories15m] [--threads 1 2] [--dtypes float32 bfloat16] [--batches 1 4] [--reps 15]

    --part linear: one product x W^T for each weight shape of SmolLM2-135M (q / o 576 x 576, k / v 192 x 576, gate / up
    1,536 x 576, down 576 x 1,536, LM head 49,152 x 576) with M = 1 / 3 / 5 / 8 / 32 rows, per dtype: F.linear and the
    packed oneDNN product (kernels/cpu_linear.py), median ms of `reps` interleaved calls.
    --part forward: the cost of a multi-token forward (speculative verification, chunked prefill): the whole model on a
    200-token DynamicCache, n = 1 / 3 / 5 / 8 new tokens per row, batch 1 and 4, with FastLinear ("ours") and with it
    switched off (stock nn.Linear), interleaved, median ms of `reps`; "n/1" is the cost of an n-token forward over a
    1-token one. Also prints the largest logit difference between the two.
    """
    print(f"torch {torch.__version__}, oneDNN bf16: {onednn_linear_unsupported(torch.bfloat16) or 'yes'}")
    if "linear" in args.part:
        part_linear(args)
    if "forward" in args.part:
        part_forward(args)


# ---------------------------------------------------------------------------------------------------------------- flex
def per_call_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def flex_options(parser) -> None:
    pass


def flex(args):
    """Why the "paged_kv" reference attention gathers then runs SDPA instead of flex_attention, on CPU.

        .venv/bin/python scripts/bench_kernels.py flex

    Decode attention (one query per row) over gathered K/V, stories260k-like heads (8 query heads, 4 KV heads,
    head_dim 8), fp32, 2 threads: SDPA vs torch's flex_attention without torch.compile (its CPU fallback materializes
    the full score matrix). Prints microseconds per call and the ratio.
    """
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


PARTS: dict[str, benchlib.Part] = {
    "gpu": (gpu_options, gpu),
    "mla-decode": (mla_decode_options, mla_decode),
    "latent-kv-decode": (latent_kv_decode_options, latent_kv_decode),
    "fast-linear": (fast_linear_bench_options, fast_linear_bench),
    "flex": (flex_options, flex),
}

if __name__ == "__main__":
    benchlib.run_parts(__doc__, PARTS)
