"""The OpenAI server under bounded load on 127.0.0.1: latency p50/p99 of bursts, the server's wall time against the
offline engine on the same requests (the ratio is the HTTP + JSON + threadpool overhead), /health latency while a
large body is tokenized, and the SIGTERM drain (time to exit with requests still running).

    .venv/bin/python scripts/bench_server.py [--model default] [--bursts 8,32] [--max-tokens 32] [--drain-timeout 2]

Starts `hf-attn serve` as a subprocess (so SIGTERM is real); the offline baseline runs the same Engine in this
process. Prints one table; figures go to BENCHMARKS.md with this command.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PROMPTS = ["Once upon a time", "The little dog", "One day, Lily went to the park", "Tom had a red ball",
           "The sun was hot and", "Mom said to Ben", "In the forest there was", "A big fish swam"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float = 300) -> tuple[int, float]:
    """(status, seconds) of one request."""
    start = time.perf_counter()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
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
    command = [sys.executable, "-m", "hf_attn_patch.cli", "serve", model, "--port", str(port), "--drain-timeout",
               str(drain)]  # fmt: skip
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
    bodies = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0, "seed": i}
              for i in range(size)]  # fmt: skip
    start = time.perf_counter()
    with ThreadPoolExecutor(size) as pool:
        results = list(pool.map(lambda b: post(port, "/v1/completions", b), bodies))
    return [t for _, t in results], time.perf_counter() - start, sum(s != 200 for s, _ in results)


def offline(model_name: str, size: int, max_tokens: int) -> float:
    """The same requests through Engine.generate in this process -> wall seconds."""
    from hf_attn_patch.models.pretrained import load_source
    from hf_attn_patch.engine import Engine, SamplingParams

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
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--bursts", default="8,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--drain-timeout", type=float, default=2.0)
    args = parser.parse_args()
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
    print(f"/health p50 idle {idle * 1000:.1f} ms; max while a 2 MB prompt was parsed+tokenized ({took:.2f} s) "
          f"{busy * 1000:.1f} ms")
    elapsed, reasons = drain(args.model, args.drain_timeout)
    counts = {r: reasons.count(r) for r in sorted(set(reasons))}
    print(f"SIGTERM with --drain-timeout {args.drain_timeout:g}: exited after {elapsed:.2f} s; streamed choices "
          f"ended with {counts}")


if __name__ == "__main__":
    main()
