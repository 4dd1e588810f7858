"""Memory: the bytes the paged KV cache holds, and the peak memory of a conversion or a forward as depth grows.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_memory.py PART [options]     # PART --help: its options

Parts:
    cache    paged KV cache against DynamicCache / StaticCache: bytes held, decode throughput, prefix caching
    convert  the layer-streamed conversion's peak RSS against depth (synthetic deep sources, one subprocess each)
    stream   the layer-streamed forward's peak RSS against the whole model's, against depth
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

import hf_attn_patch  # noqa: F401
from hf_attn_patch import PagedKVCache
from hf_attn_patch.cache.generate_hook import pool_blocks_for_generation
from hf_attn_patch.compat import cache_kwarg
from hf_attn_patch.kv_memory import kv_cache_bytes
from hf_attn_patch.models import load_default, load_smollm2

import benchlib


# --------------------------------------------------------------------------------------------------------------- cache
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
                token = (
                    model(token, attention_mask=step_mask, position_ids=position, **cache_kwarg(cache))
                    .logits[:, -1:]
                    .argmax(-1)
                )
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
        print(
            f"   {name:<14}{batch:>6}{context:>9}{'yes' if padded else 'no':>8}{dynamic:>10.1f}{paged:>10.1f}"
            f"{paged / dynamic:>7.2f}x"
        )


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


def cache_options(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="stories260k only, context 512")
    parser.add_argument("--threads", type=int, default=2)


def cache(args):
    """PagedKVCache vs transformers' DynamicCache / StaticCache, in one process: memory, decode speed, prefix caching.

        .venv/bin/python scripts/bench_memory.py cache [--quick] [--threads 2]

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
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, CPU")
    stories, _ = load_default()
    memory(stories, block_size=16, new_tokens=256)
    cases = [("stories260k", stories, batch, context, False) for batch in (1, 8) for context in (512, 2048)]
    cases.append(("stories260k", stories, 8, 512, True))
    if not args.quick:
        smollm2 = load_smollm2()[0]
        # batch 8 at 2048 would spend minutes in SmolLM2's prefill on 2 cores: left out
        cases += [
            ("SmolLM2-135M", smollm2, batch, context, padded)
            for batch, context, padded in ((1, 512, False), (8, 512, False), (1, 2048, False), (8, 512, True))
        ]
    else:
        cases = [c for c in cases if c[3] == 512]
    throughput(cases, steps=32)
    prefix_ttft(stories if args.quick else smollm2, 496 if args.quick else 1024)


# ------------------------------------------------------------------------------------------------------------- convert
TARGETS = {"mla": dict(to="mla", kv_budget=0.5, rank_allocation="uniform"), "mqa": dict(to="mqa")}
COMMON = dict(calib_source="text", calib_samples=8, calib_len=128, reconstruct_steps=2)


def tokenizer_folder(name: str) -> tuple[Path, int]:
    """(folder holding the tokenizer's files, its vocabulary size)."""
    if name == "smollm2":
        from hf_attn_patch.models.pretrained import smollm2_dir

        return smollm2_dir(), 49152
    from hf_attn_patch.models.pretrained import DEFAULT_MODEL_DIR

    return Path(DEFAULT_MODEL_DIR), 512


def make_source(folder: Path, depth: int, width: int, tokenizer: str) -> int:
    """A synthetic source with the tokenizer's files beside it; returns its weights' bytes."""
    tok, vocab = tokenizer_folder(tokenizer)
    size = build_source(folder, depth, width, vocab)
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or f.suffix == ".jinja":
            shutil.copy(f, folder / f.name)
    return size


def convert_child(args) -> None:
    """Warm-up conversion, floor, measured conversion, in this fresh process; prints one JSON line."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from hf_attn_patch.converters.convert import convert

    options = {**TARGETS[args.target], **COMMON}
    with tempfile.TemporaryDirectory() as tmp:
        convert(args.warmup, Path(tmp) / "warm", **options)
        floor = rss_mb()
        start = time.perf_counter()
        report = convert(args.folder, Path(tmp) / "out", **options)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "floor_mb": floor,
                "peak_rss_mb": report["peak_rss_mb"],
                "seconds": seconds,
                "stages": report["stages"],
                "activations": report["activations"],
            }
        )
    )


def run_child(target: str, folder: Path, warmup: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "convert",
        "--child",
        "--target",
        target,
        "--folder",
        str(folder),
        "--warmup",
        str(warmup),
    ]
    # a fixed mmap threshold: glibc otherwise raises it after each large free, so freed tensors stay in the heap or
    # go back to the OS depending on the history, and the RSS floor and peak wander by ~10 MB from run to run
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{target} conversion failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def convert_measure(depths: list[int], width: int, targets: list[str], tokenizer: str, printer=print) -> list[dict]:
    """Rows {layers, target, source_bytes, floor_mb, peak_rss_mb, seconds, ...} per depth and target."""
    rows = []
    for depth in depths:
        root = Path(tempfile.mkdtemp(prefix="bench-convert-"))
        try:
            size = make_source(root / "src", depth, width, tokenizer)
            make_source(root / "warm", 2, width, tokenizer)
            for target in targets:
                r = run_child(target, root / "src", root / "warm")
                row = {"layers": depth, "target": target, "source_bytes": size, **r}
                rows.append(row)
                mb = size / 2**20
                printer(
                    f"{depth:>6} {target:>4} {mb:>9.0f} | {r['floor_mb']:>6.0f} {r['peak_rss_mb']:>8.0f} "
                    f"{r['peak_rss_mb'] - r['floor_mb']:>10.0f} {r['peak_rss_mb'] / mb:>10.2f} "
                    f"{(r['peak_rss_mb'] - r['floor_mb']) / mb:>12.3f} | {r['seconds']:>7.1f} "
                    f"{r['seconds'] / depth:>7.2f} | {r['activations']['placement']}"
                )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def convert_memory_options(parser) -> None:
    parser.add_argument("--depths", default="30,60,120")
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--targets", default="mla,mqa")
    parser.add_argument("--tokenizer", choices=["smollm2", "default"], default="smollm2")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", help=argparse.SUPPRESS)


def convert_memory(args):
    """Peak memory and time of convert() (layer-streamed) against depth, on synthetic deep sources.

        OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_memory.py convert [--depths 30,60,120] [--width 576]
            [--targets mla,mqa] [--tokenizer smollm2|default] [--json rows.json]

    Per depth, a Llama source of random weights (SmolLM2-135M's shape at --width 576, the stream part's
    synthetic_config; vocab 49152 with SmolLM2's tokenizer, or 512 with the embedded stories260k's) is written layer by
    layer into a temporary folder by a subprocess. Each conversion then runs in a fresh subprocess: first a 2-layer
    source of the same width is converted (imports and allocator pools warmed), the RSS is read (the floor), then the
    deep one: MLA 50% (kv_budget 0.5, uniform ranks) or MQA, calibration on 8 windows of 128 tokens of the package's
    text, 2 reconstruction steps per layer. Printed: the source's bytes, the report's peak_rss_mb (VmHWM over the
    stages), peak - floor, their ratios to the source's bytes (target: peak_rss_mb <= 40% of the source), seconds and
    seconds per layer. Memory flat and time linear in depth: peak - floor stays near constant, seconds / layer too.
    Sensitivity ranks (the default for MLA by budget) stream too, with O(L^2) layer reads: not run here at 120 layers.
    """
    if args.child:
        return convert_child(args)
    if args.width % 64 or args.width < 192:
        args.parser.error(f"--width={args.width} must be a multiple of 64, at least 192")
    print(f"width {args.width}, fp32, {COMMON}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}; MB")
    print(
        f"{'layers':>6} {'to':>4} {'source':>9} | {'floor':>6} {'peak':>8} {'peak-floor':>10} {'peak/src':>10} "
        f"{'(p-f)/src':>12} | {'s':>7} {'s/layer':>7} | activations"
    )
    rows = convert_measure(
        [int(d) for d in args.depths.split(",")], args.width, args.targets.split(","), args.tokenizer
    )
    if args.json:
        benchlib.write_rows(args.json, rows, indent=2)


# -------------------------------------------------------------------------------------------------------------- stream
def rss_mb() -> float:
    """Current resident set size of this process in MB, from /proc/self/statm."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> tuple[float, float]:
    """(VmHWM, ru_maxrss) in MB. VmHWM is this process image's own peak RSS; Linux carries ru_maxrss over from the
    parent's memory through fork + exec, so the parent stays small (it builds nothing) to keep the two equal."""
    hwm = next(
        int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:")
    )
    return hwm / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # both in KB


@dataclass
class StreamResult:
    """hidden: the last decoder layer's output [N, T, D] (before the final norm), where `placement` says.
    activation_bytes: bytes of one buffer (N * T * D * itemsize). Close it (or use `with`) to free a disk placement."""

    hidden: torch.Tensor
    placement: str
    activation_bytes: int
    store: object = field(repr=False)

    def close(self) -> None:
        self.hidden = None
        self.store.close()

    def __enter__(self) -> "StreamResult":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream_forward(
    src,
    input_ids: torch.Tensor,
    *,
    chunk_size: int = 8,
    placement: str | None = None,
    device_budget: int | None = None,
    cpu_budget: int | None = None,
    tmp_root=None,
    on_layer=None,
) -> StreamResult:
    """Run the windows input_ids [N, T] through the source's (a LayerSource) decoder layers, one layer resident at a
    time. chunk_size: windows per layer call. placement: force 'device' / 'cpu' / 'disk', else chosen by
    `choose_placement` from the budgets. on_layer(i, layer, inputs, outputs): called after layer i ran over all
    windows, before it is freed. Returns the last layer's output; `src.head` makes logits."""
    from hf_attn_patch.converters.io.layer_stream import Activations, LayerRunner, choose_placement

    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [N, T] windows, got shape {tuple(input_ids.shape)}")
    n, t = input_ids.shape
    runner = LayerRunner(src, t, chunk_size)
    nbytes = n * t * src.config.hidden_size * torch.empty((), dtype=src.dtype).element_size()
    placement = placement or choose_placement(nbytes, src.device, device_budget, cpu_budget)
    if placement == "device" and src.device.type == "cpu":
        placement = "cpu"  # the device is the CPU: say so
    store = Activations.allocate((n, t, src.config.hidden_size), src.dtype, placement, src.device, tmp_root)
    try:
        runner.embed(input_ids, store.current)
        for i in range(src.num_layers):
            layer = src.layer(i)
            runner.apply(layer, i, store.current, store.spare)
            if on_layer is not None:
                on_layer(i, layer, store.current, store.spare)
            del layer  # freed before the next layer is read
            store.swap()
    except BaseException:
        store.close()
        raise
    return StreamResult(store.current, placement, nbytes, store)


@torch.no_grad()
def stream_logits(src, result: StreamResult, chunk_size: int = 8) -> torch.Tensor:
    """Logits [N, T, V] on the CPU from a StreamResult: lm_head(norm(hidden)), chunk by chunk."""
    hidden = result.hidden
    return torch.cat([src.head(hidden[lo : lo + chunk_size]).cpu() for lo in range(0, hidden.shape[0], chunk_size)])


def synthetic_config(depth: int, width: int, vocab: int = 49152):
    """A Llama config of SmolLM2-135M's proportions at `width` (head_dim 64, 3:1 GQA, MLP 8/3 x width)."""
    from transformers import LlamaConfig

    heads = width // 64
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3,
        num_hidden_layers=depth,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3),
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )


def build_source(folder: Path, depth: int, width: int, vocab: int = 49152) -> int:
    """Write a random source of `depth` layers to `folder`, one layer at a time; returns its weights' bytes."""
    from transformers import LlamaForCausalLM

    from hf_attn_patch.converters.io.layer_writer import ShardedWriter

    config = synthetic_config(depth, width, vocab)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)

    def rand(shapes: dict) -> dict:
        return {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}

    with ShardedWriter(folder, max_shard_size="1GB") as writer:
        writer.add(rand({"model.embed_tokens.weight": skeleton.model.embed_tokens.weight.shape}))
        for i, layer in enumerate(skeleton.model.layers):
            writer.add(rand({f"model.layers.{i}.{k}": v.shape for k, v in layer.state_dict().items()}))
        writer.add(rand({"model.norm.weight": skeleton.model.norm.weight.shape}))
        writer.finish(config)
    return writer.total_bytes


def stream_child(args) -> None:
    """One measured run (or the source's build) in this fresh process; prints one JSON line."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (imported before the floor)

    from hf_attn_patch.converters.io.layer_source import LayerSource
    from hf_attn_patch.converters.io.layer_writer import ShardedWriter  # noqa: F401

    floor = rss_mb()
    if args.child == "build":
        size = build_source(Path(args.folder), args.depth, args.width)
        print(json.dumps({"source_bytes": size, "floor_mb": floor, "peak_mb": peak_rss_mb()[0]}))
        return
    ids = torch.randint(0, 49152, (args.windows, args.tokens), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    with torch.no_grad():
        if args.child == "streamed":
            src = LayerSource.open(args.folder)
            with stream_forward(src, ids, chunk_size=args.windows, placement=args.placement) as result:
                logits = src.head(result.hidden[:, -1:])
                placement = result.placement
        else:
            model = AutoModelForCausalLM.from_pretrained(args.folder).eval()
            logits = model(ids, logits_to_keep=1).logits
            placement = "whole model"
    seconds = time.perf_counter() - start
    torch.save(logits, args.logits_out)
    hwm, maxrss = peak_rss_mb()
    print(
        json.dumps(
            {"floor_mb": floor, "peak_mb": hwm, "ru_maxrss_mb": maxrss, "seconds": seconds, "placement": placement}
        )
    )


def stream_measure(mode: str, folder: Path, args, logits_out: Path | None = None, depth: int = 0) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "stream",
        "--child",
        mode,
        "--folder",
        str(folder),
        "--windows",
        str(args.windows),
        "--tokens",
        str(args.tokens),
        "--placement",
        args.placement,
        "--logits-out",
        str(logits_out),
        "--depth",
        str(depth),
        "--width",
        str(args.width),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def stream_memory_options(parser) -> None:
    parser.add_argument("--depths", default="30,60,120")
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--placement", choices=["cpu", "disk"], default="cpu", help="where the activations are kept")
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-model baseline runs")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", choices=["build", "streamed", "whole"], help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--logits-out", help=argparse.SUPPRESS)


def stream_memory(args):
    """Peak memory and time of the layer-streamed forward against depth, next to the whole model's forward.

        OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_memory.py stream [--depths 30,60,120] [--width 576]
            [--windows 8] [--tokens 256] [--placement cpu|disk] [--no-whole] [--json rows.json]

    Per depth, a synthetic Llama source of random weights (SmolLM2-135M's shape at --width 576: 9 query heads, 3 KV heads,
    head_dim 64, MLP 1536, vocab 49152, tied embeddings; other widths scale heads and MLP) is written layer by layer into
    a temporary folder (safetensors, 1 GB shards) by a subprocess. Then, each in a fresh subprocess of its own:
    - streamed: LayerSource.open + stream_forward (below: the library's LayerRunner) over --windows windows of --tokens tokens (one chunk of all windows,
      activations in CPU memory, or memory-mapped files with --placement disk), logits of the last position;
    - whole: AutoModelForCausalLM.from_pretrained + one forward of the same windows (logits_to_keep=1).
    Printed per run: the source's size, RSS after the imports (the floor), peak RSS (VmHWM of /proc/self/status, and
    resource.getrusage ru_maxrss as a check), the seconds from opening the source to the logits, and the two runs'
    last-position logits compared (they must be equal); and the peak RSS over its floor of the process that wrote the
    source layer by layer (ShardedWriter).
    Memory flat and time linear in depth: the streamed peak minus the floor stays near constant, seconds / layer too.
    """
    if args.child:
        return stream_child(args)
    depths = [int(d) for d in args.depths.split(",")]
    if args.width % 64 or args.width < 192:
        args.parser.error(f"--width={args.width} must be a multiple of 64, at least 192")
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    print(
        f"width {args.width}, {args.windows} windows x {args.tokens} tokens, fp32, activations on {args.placement}, "
        f"OMP_NUM_THREADS={threads}; RSS in MB"
    )
    header = (
        f"{'layers':>6} {'source MB':>9} | {'floor':>6} {'streamed peak':>13} {'maxrss':>6} {'peak-floor':>10} "
        f"{'s':>7} {'s/layer':>7} | {'whole peak':>10} {'peak-floor':>10} {'s':>7} | {'stream/whole peak':>17} "
        f"logits | build peak-floor"
    )
    print(header)
    rows = []
    for depth in depths:
        root = Path(tempfile.mkdtemp(prefix="bench-stream-"))
        try:
            b = stream_measure("build", root / "src", args, depth=depth)  # built (ShardedWriter) in its own process too
            size = b["source_bytes"]
            s = stream_measure("streamed", root / "src", args, root / "s.pt")
            w = None if args.no_whole else stream_measure("whole", root / "src", args, root / "w.pt")
            same = (
                "-"
                if w is None
                else ("equal" if torch.equal(torch.load(root / "s.pt"), torch.load(root / "w.pt")) else "DIFFER")
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
        row = {"layers": depth, "source_bytes": size, "build": b, "streamed": s, "whole": w, "logits": same}
        rows.append(row)
        whole = (
            (
                f"{w['peak_mb']:>10.0f} {w['peak_mb'] - w['floor_mb']:>10.0f} {w['seconds']:>7.1f} | "
                f"{s['peak_mb'] / w['peak_mb']:>17.2f}"
            )
            if w
            else f"{'-':>10} {'-':>10} {'-':>7} | {'-':>17}"
        )
        print(
            f"{depth:>6} {size / 2**20:>9.0f} | {s['floor_mb']:>6.0f} {s['peak_mb']:>13.0f} "
            f"{s['ru_maxrss_mb']:>6.0f} "
            f"{s['peak_mb'] - s['floor_mb']:>10.0f} {s['seconds']:>7.1f} {s['seconds'] / depth:>7.3f} | "
            f"{whole} {same:>6} | {b['peak_mb'] - b['floor_mb']:>16.0f}",
            flush=True,
        )
    if args.json:
        benchlib.write_rows(args.json, rows, indent=2)


PARTS: dict[str, benchlib.Part] = {
    "cache": (cache_options, cache),
    "convert": (convert_memory_options, convert_memory),
    "stream": (stream_memory_options, stream_memory),
}

if __name__ == "__main__":
    benchlib.run_parts(__doc__, PARTS)
