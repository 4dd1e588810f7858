"""Engine: continuous batching against static batches of generate() and transformers' own manager, hybrid models,
and the OpenAI server against the in-process engine.

    .venv/bin/python scripts/bench_engine.py PART [options]     # PART --help: its options

Parts:
    batching  the engine against static generate() batches and transformers' continuous batching: throughput,
              TTFT / TPOT / inter-token latency, prefix caching, chunked prefill (plot: results/engine/latency.png)
    hybrid    the engine against static generate() batches on random hybrid models (state layers + attention)
    server    `hf-attn serve` as a subprocess under bursts of completions against the in-process engine
    revision  this tree's engine against the engine of a git revision: offline throughput in alternating child
              processes, and whether every generated token is the same (for a refactor of the engine)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import hf_attn_patch  # noqa: F401
from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.models.pretrained import load_default, load_smollm2

import benchlib


# ------------------------------------------------------------------------------------------------------------ batching
def workload(tokenizer, text_file: str, n: int, max_prompt: int, max_out: int, seed: int = 0):
    """[(prompt ids, output length)] with lengths uniform in [16, max]."""
    ids = tokenizer((benchlib.CORPORA / text_file).read_text(encoding="utf-8")[:400_000]).input_ids
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(16, max_prompt)
        start = rng.randrange(0, len(ids) - length)
        out.append((ids[start : start + length], rng.randint(16, max_out)))
    return out


def summary(name, tokens, seconds, ttft, tpot, itl=None) -> dict:
    ttft, tpot = np.array(ttft) * 1000, np.array(tpot) * 1000
    extra = (
        {}
        if itl is None
        else {"itl50": np.percentile(np.array(itl) * 1000, 50), "itl99": np.percentile(np.array(itl) * 1000, 99)}
    )
    return {
        **extra,
        "name": name,
        "tok/s": tokens / seconds,
        "seconds": seconds,
        "ttft": ttft,
        "tpot": tpot,
        "ttft50": np.percentile(ttft, 50),
        "ttft99": np.percentile(ttft, 99),
        "tpot50": np.percentile(tpot, 50),
        "tpot99": np.percentile(tpot, 99),
    }


def engine_options(max_prompt: int, max_out: int) -> dict:
    """The engine settings of every batching run. max_model_len: stories260k was trained on 512 positions; its RoPE
    runs on (as generate() lets it) to 1024 + 256."""
    return dict(max_batch_tokens=256, block_size=16, max_memory=256 * 1024 * 1024, max_model_len=max_prompt + max_out)


def run_ours(model, tok, requests, arrivals=None, **options):
    """Ours; arrivals (seconds after start) make it online. -> summary inputs."""
    engine = Engine(model, tok, **options)
    arrivals = arrivals or [0.0] * len(requests)
    first, finish, last, gaps, ids, pending = {}, {}, {}, [], {}, list(range(len(requests)))
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            prompt, n = requests[i]
            ids[engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))] = i
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[pending[0]] - now))
            continue
        for out in engine.step():
            t = time.perf_counter() - start
            i = ids[out.request_id]
            if i in last:
                gaps.append(t - last[i])  # inter-token latency: a long prefill in the step shows up here
            last[i] = t
            first.setdefault(i, t)
            if out.finished:
                finish[ids[out.request_id]] = t
    seconds = time.perf_counter() - start
    ttft = [first[i] - arrivals[i] for i in range(len(requests))]
    tpot = [(finish[i] - first[i]) / max(1, n - 1) for i, (_, n) in enumerate(requests)]
    engine.inter_token_gaps = gaps
    return seconds, ttft, tpot, engine


def run_transformers_cb(model, requests, max_batch_tokens: int):
    config = GenerationConfig(
        max_new_tokens=max(n for _, n in requests), do_sample=False, eos_token_id=None, pad_token_id=0
    )
    manager = model.init_continuous_batching(generation_config=config)
    start = time.perf_counter()
    manager.start()
    rids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True, eos_token_id=[]) for p, n in requests]
    results = {}
    while len(results) < len(rids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            results[result.request_id] = result
    seconds = time.perf_counter() - start
    manager.stop(block=True)
    outs = [results[r] for r in rids]
    ttft = [o.timestamps[0] - start for o in outs]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / max(1, len(o.timestamps) - 1) for o in outs]
    return seconds, ttft, tpot, sum(len(o.generated_tokens) for o in outs)


class _StepClock(StoppingCriteria):
    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_static(model, tok, requests, batch_size: int = 8):
    ttft, tpot = [], []
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        group = requests[b : b + batch_size]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        clock = _StepClock()
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(n for _, n in group),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
        for _, n in group:  # request i's tokens are ready at step n (it waits for the batch to finish)
            ttft.append(clock.times[0] - start)
            tpot.append((clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1))
    return time.perf_counter() - start, ttft, tpot


def table(rows, baseline: str) -> None:
    base = next(r for r in rows if r["name"] == baseline)["tok/s"]
    itl = all("itl99" in r for r in rows)
    print(
        "| system | tok/s | vs "
        + baseline
        + " | TTFT p50 / p99 ms | TPOT p50 / p99 ms |"
        + (" inter-token p50 / p99 ms |" if itl else "")
    )
    print("|---|---|---|---|---|" + ("---|" if itl else ""))
    for r in rows:
        print(
            f"| {r['name']} | {r['tok/s']:.1f} | {r['tok/s'] / base:.2f}x | {r['ttft50']:.0f} / {r['ttft99']:.0f} | "
            f"{r['tpot50']:.1f} / {r['tpot99']:.1f} |" + (f" {r['itl50']:.1f} / {r['itl99']:.1f} |" if itl else "")
        )


def bench(label, model, tok, text_file, n, max_prompt, max_out, rate, plots):
    tok.pad_token = tok.pad_token or tok.eos_token
    requests = workload(tok, text_file, n, max_prompt, max_out)
    tokens = sum(k for _, k in requests)
    options = engine_options(max_prompt, max_out)
    print(f"\n## {label}: {n} requests, prompts 16..{max_prompt}, outputs 16..{max_out} ({tokens} tokens)\n")
    run_ours(model, tok, requests[:2], **options)  # warm-up
    rows = []
    seconds, ttft, tpot, engine = run_ours(model, tok, requests, **options)
    rows.append(summary("ours (engine)", tokens, seconds, ttft, tpot))
    try:
        seconds, ttft, tpot, produced = run_transformers_cb(model, requests, options["max_batch_tokens"])
        rows.append(summary("transformers continuous batching", produced, seconds, ttft, tpot))
    except Exception as error:  # report, do not hide: the baseline failed on this model
        print(f"transformers continuous batching failed: {type(error).__name__}: {error}")
    seconds, ttft, tpot = run_static(model, tok, requests)
    rows.append(summary("static batches of 8, generate()", tokens, seconds, ttft, tpot))
    print("Offline (all requests at t=0):\n")
    table(rows, rows[1]["name"] if len(rows) > 2 else rows[-1]["name"])
    plots.append((f"{label}, offline", rows))

    arrivals = list(np.cumsum(np.random.default_rng(1).exponential(1 / rate, n)))
    online = []
    for chunked in (True, False):
        seconds, ttft, tpot, engine = run_ours(
            model, tok, requests, arrivals, chunked_prefill=chunked, prefill_chunk=64, **options
        )
        online.append(
            summary(
                f"ours, chunked prefill {'on (64)' if chunked else 'off'}",
                tokens,
                seconds,
                ttft,
                tpot,
                engine.inter_token_gaps,
            )
        )
    print(f"\nOnline (Poisson arrivals, {rate} requests/s):\n")
    table(online, online[1]["name"])
    plots.append((f"{label}, online {rate} req/s", online))

    system = workload(tok, text_file, 1, 512, 16, seed=3)[0][0][:512]
    shared = [(system + p[:16], 16) for p, _ in workload(tok, text_file, 16, 16, 16, seed=4)]
    prefix = []
    for caching in (True, False):
        seconds, ttft, tpot, engine = run_ours(model, tok, shared, prefix_caching=caching, **options)
        prefix.append(summary(f"ours, prefix cache {'on' if caching else 'off'}", 16 * 16, seconds, ttft, tpot))
    print("\nShared 512-token system prompt, 16 requests:\n")
    table(prefix, prefix[1]["name"])


def plot(plots, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(plots), 2, figsize=(11, 3.2 * len(plots)), squeeze=False)
    for (title, rows), (left, right) in zip(plots, axes):
        for r in rows:
            for ax, key in ((left, "ttft"), (right, "tpot")):
                values = np.sort(r[key])
                ax.plot(values, np.linspace(0, 1, len(values)), label=r["name"])
        left.set(title=f"{title}: time to first token", xlabel="ms", ylabel="fraction of requests", xscale="log")
        right.set(title=f"{title}: time per output token", xlabel="ms", xscale="log")
        left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def batching_options(parser) -> None:
    parser.add_argument("--model", choices=["stories", "smollm2", "both"], default="both")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)


def batching(args):
    """Our Engine vs transformers' continuous batching vs static-batched generate(), in one process.

        .venv/bin/python scripts/bench_engine.py batching [--model stories|smollm2|both] [--requests 64] [--threads 2]

    Workload (seeded): N requests, prompts of 16..P tokens cut from real text (TinyStories sample / WikiText-2),
    outputs of 16..O tokens (EOS ignored, so every system produces exactly the same number of tokens). Greedy.
    1. Offline (all requests at t=0): throughput (generated tokens / wall s), time to first token (TTFT) and time per
       output token (TPOT) p50 / p99 for: ours; transformers' ContinuousBatchingManager (what generate_batch runs, with
       per-request max_new_tokens and token timestamps); static batches of 8 with generate() (FIFO, left-padded,
       every batch runs to its longest output).
    2. Online (Poisson arrivals): ours with chunked prefill on vs off: TTFT, TPOT and inter-token latency p50 / p99
       (a step that prefills a long prompt whole delays every decode in it: that shows in the inter-token p99).
    3. Prefix caching: 16 requests sharing a 512-token system prompt: TTFT with the prefix cache on vs off.
    Plots the TTFT / TPOT distributions to scripts/bench_engine.png.
    """
    torch.set_num_threads(args.threads)
    plots = []
    if args.model in ("stories", "both"):
        model, tok = load_default()
        bench("stories260k", model, tok, "tinystories_sample.txt", args.requests, 1024, 256, 8.0, plots)
    if args.model in ("smollm2", "both"):
        model, tok = load_smollm2()
        bench("SmolLM2-135M", model, tok, "wikitext2_test.txt", max(8, args.requests // 2), 512, 128, 1.0, plots)
    plot(plots, benchlib.RESULTS / "engine" / "latency.png")


# -------------------------------------------------------------------------------------------------------------- hybrid
HYBRID_COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=2,
    pad_token_id=0,
)
CONFIGS = {
    "lfm2": dict(layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3),
    "qwen3_next": dict(
        layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
    "bamba": dict(
        attn_layer_indices=[2],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=32,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=16,
    ),
}


def hybrid_workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(3, 512) for _ in range(rng.randint(16, 64))], rng.randint(16, 48)) for _ in range(n)]


def run_engine(model, tokenizer, requests) -> tuple[float, int]:
    engine = Engine(model, tokenizer, max_batch_tokens=256, block_size=16)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in requests]
    start = time.perf_counter()
    outputs = engine.generate([p for p, _ in requests], params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def hybrid_static(model, requests, batch: int = 8) -> tuple[float, int]:
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        longest, new = max(len(p) for p, _ in chunk), max(m for _, m in chunk)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in chunk])
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        tokens += sum(m for _, m in chunk)  # the tokens the requests asked for (the rest of each row is waste)
    return time.perf_counter() - start, tokens


def hybrid_options(parser) -> None:
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)


def hybrid(args):
    """Our Engine vs static batches of generate() on hybrid models (constant-state layers), in one process.

        .venv/bin/python scripts/bench_engine.py hybrid [--requests 32] [--threads 1]

    Models: small random-init LFM2 (short conv), Qwen3-Next (gated delta net) and Bamba (Mamba2), seeded, fp32, 4
    layers (3 state layers + 1 attention), hidden 128 (no hybrid checkpoint is available offline; speed does not depend
    on the weights). Workload (seeded): N requests, prompts of 16..64 random tokens, outputs of 16..48 tokens (EOS
    ignored, so both sides produce exactly the same number of tokens). Greedy. Baseline: static batches of 8 with
    generate() (FIFO, left-padded, each batch runs to its longest output). Prints tokens/s of each and the ratio.
    """
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    tokenizer = load_default()[1]
    requests = hybrid_workload(args.requests)
    print(f"hf_attn_patch {hf_attn_patch.__version__}, {args.requests} requests, {args.threads} thread(s)")
    print("| model | engine tok/s | static generate() tok/s | ratio |")
    print("|---|---|---|---|")
    for model_type, overrides in CONFIGS.items():
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(model_type, **{**HYBRID_COMMON, **overrides})
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        run_engine(model, tokenizer, requests[:4])  # warm-up (first-call allocations)
        ours, ours_tokens = run_engine(model, tokenizer, requests)
        base, base_tokens = hybrid_static(model, requests)
        ratio = (ours_tokens / ours) / (base_tokens / base)
        print(f"| {model_type} | {ours_tokens / ours:.1f} | {base_tokens / base:.1f} | {ratio:.2f}x |")


# -------------------------------------------------------------------------------------------------------------- server
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "One day, Lily went to the park",
    "Tom had a red ball",
    "The sun was hot and",
    "Mom said to Ben",
    "In the forest there was",
    "A big fish swam",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float = 300) -> tuple[int, float]:
    """(status, seconds) of one request."""
    start = time.perf_counter()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            reply.read()
            status = reply.status
    except urllib.error.HTTPError as error:
        status = error.code
    return status, time.perf_counter() - start


def get(port: int, path: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as reply:
        reply.read()
    return time.perf_counter() - start


def start_server(model: str, drain: float) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "hf_attn_patch.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--drain-timeout",
        str(drain),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            get(port, "/health")
            return process, port
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not start within 120 s")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def burst(port: int, size: int, max_tokens: int) -> tuple[list[float], float, int]:
    """`size` concurrent completions -> (latencies, wall seconds, non-200 count)."""
    bodies = [
        {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0, "seed": i}
        for i in range(size)
    ]
    start = time.perf_counter()
    with ThreadPoolExecutor(size) as pool:
        results = list(pool.map(lambda b: post(port, "/v1/completions", b), bodies))
    return [t for _, t in results], time.perf_counter() - start, sum(s != 200 for s, _ in results)


def offline(model_name: str, size: int, max_tokens: int) -> float:
    """The same requests through Engine.generate in this process -> wall seconds."""
    from hf_attn_patch.engine import Engine, SamplingParams
    from hf_attn_patch.models.pretrained import load_source

    model, tokenizer = load_source(model_name)
    engine = Engine(model, tokenizer)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(size)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, seed=i) for i in range(size)]
    engine.generate(prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def health_under_big_body(port: int) -> tuple[float, float, float]:
    """(/health p50 idle, /health max while a ~2 MB prompt is parsed and tokenized, that request's seconds)."""
    idle = [get(port, "/health") for _ in range(20)]
    done, busy, took = threading.Event(), [], []

    def big():
        took.append(post(port, "/v1/completions", {"prompt": "Once upon a time there was a cat. " * 60_000})[1])
        done.set()

    threading.Thread(target=big).start()
    while not done.is_set():
        busy.append(get(port, "/health"))
    return statistics.median(idle), max(busy) if busy else float("nan"), took[0]


def drain(model: str, seconds: float) -> tuple[float, list[str]]:
    """Start long streams, SIGTERM, -> (seconds from the signal to the exit, finish reasons the streams got)."""
    process, port = start_server(model, seconds)
    reasons: list[str] = []

    def stream():
        body = {"prompt": "Once upon a time", "max_tokens": 480, "n": 16, "stream": True, "temperature": 1.0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            for line in reply:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice["finish_reason"]:
                            reasons.append(choice["finish_reason"])

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    start = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=seconds + 60)
    elapsed = time.perf_counter() - start
    for t in threads:
        t.join(timeout=10)
    return elapsed, reasons


def server_options(parser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--bursts", default="8,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--drain-timeout", type=float, default=2.0)


def server(args):
    """The OpenAI server under bounded load on 127.0.0.1: latency p50/p99 of bursts, the server's wall time against the
    offline engine on the same requests (the ratio is the HTTP + JSON + threadpool overhead), /health latency while a
    large body is tokenized, and the SIGTERM drain (time to exit with requests still running).

        .venv/bin/python scripts/bench_engine.py server [--model default] [--bursts 8,32] [--max-tokens 32] [--drain-timeout 2]

    Starts `hf-attn serve` as a subprocess (so SIGTERM is real); the offline baseline runs the same Engine in this
    process. Prints one table; figures go to BENCHMARKS.md with this command.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = [int(s) for s in args.bursts.split(",")]
    process, port = start_server(args.model, 10.0)
    rows = []
    try:
        burst(port, 2, args.max_tokens)  # warm-up
        for size in sizes:
            latencies, wall, errors = burst(port, size, args.max_tokens)
            rows.append((size, percentile(latencies, 0.5), percentile(latencies, 0.99), wall, errors))
        idle, busy, took = health_under_big_body(port)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    print(f"model {args.model}, {args.max_tokens} tokens per request, greedy, 127.0.0.1, default server settings")
    print("burst | p50 s | p99 s | wall s | offline engine s | server/offline | non-200")
    for size, p50, p99, wall, errors in rows:
        base = offline(args.model, size, args.max_tokens)
        print(f"{size:5d} | {p50:.3f} | {p99:.3f} | {wall:.3f} | {base:.3f} | {wall / base:.2f}x | {errors}")
    print(
        f"/health p50 idle {idle * 1000:.1f} ms; max while a 2 MB prompt was parsed+tokenized ({took:.2f} s) "
        f"{busy * 1000:.1f} ms"
    )
    elapsed, reasons = drain(args.model, args.drain_timeout)
    counts = {r: reasons.count(r) for r in sorted(set(reasons))}
    print(
        f"SIGTERM with --drain-timeout {args.drain_timeout:g}: exited after {elapsed:.2f} s; streamed choices "
        f"ended with {counts}"
    )


# ------------------------------------------------------------------------------------------------------------ revision
def revision_options(parser) -> None:
    parser.add_argument("--against", default="main", metavar="REV", help="the git revision to compare with")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", default=None, metavar="JSON", help=argparse.SUPPRESS)


def revision_child(args) -> None:
    """One offline run of the batching workload (stories260k) -> JSON: throughput and a hash of every token."""
    torch.set_num_threads(args.threads)
    model, tok = load_default()
    requests = workload(tok, "tinystories_sample.txt", args.requests, 1024, 256)
    engine = Engine(model, tok, **engine_options(1024, 256))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    engine.generate([requests[0][0]], params[0])  # warm-up
    start = time.perf_counter()
    outputs = engine.generate([prompt for prompt, _ in requests], params)
    seconds = time.perf_counter() - start
    tokens = [out.token_ids for out in outputs]
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    result = {
        "tok/s": sum(map(len, tokens)) / seconds,
        "tokens": digest,
        "engine": sys.modules[Engine.__module__].__file__,
    }
    Path(args.child).write_text(json.dumps(result))


def revision(args):
    """This tree's engine against the engine of a git revision, offline on the batching workload (stories260k,
    greedy, EOS ignored), each run in its own child process, the two alternating `--rounds` times.

        .venv/bin/python scripts/bench_engine.py revision --against main [--requests 64] [--rounds 3] [--threads 2]

    Prints each round's throughput, the median ratio (this tree / the revision) and whether both generated exactly
    the same tokens (a hash of every request's token ids).
    """
    if args.child:
        return revision_child(args)
    runs = {"this tree": [], args.against: []}
    with benchlib.revision_checkout(args.against) as checkout, tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": benchlib.ROOT, args.against: checkout}
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
            for name in order:
                out = Path(tmp) / "result.json"
                env = {**os.environ, "PYTHONPATH": str(trees[name])}
                options = [f"--child={out}", f"--threads={args.threads}", f"--requests={args.requests}"]
                command = [sys.executable, __file__, "revision", *options]
                subprocess.run(command, env=env, check=True, cwd=trees[name])
                result = json.loads(out.read_text())
                assert Path(result["engine"]).is_relative_to(trees[name]), result["engine"]
                runs[name].append(result)
                print(f"round {round_ + 1} {name}: {result['tok/s']:.1f} tok/s, tokens {result['tokens']}")
    ours = statistics.median(r["tok/s"] for r in runs["this tree"])
    base = statistics.median(r["tok/s"] for r in runs[args.against])
    same = {r["tokens"] for r in runs["this tree"] + runs[args.against]}
    print(
        f"median: this tree {ours:.1f} tok/s, {args.against} {base:.1f} tok/s: ratio {ours / base:.3f}x; "
        f"tokens {'identical' if len(same) == 1 else 'DIFFERENT'}"
    )


PARTS: dict[str, benchlib.Part] = {
    "batching": (batching_options, batching),
    "hybrid": (hybrid_options, hybrid),
    "server": (server_options, server),
    "revision": (revision_options, revision),
}

if __name__ == "__main__":
    benchlib.run_parts(__doc__, PARTS)
