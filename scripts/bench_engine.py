"""Our Engine vs transformers' continuous batching vs static-batched generate(), in one process.

    .venv/bin/python scripts/bench_engine.py [--model stories|smollm2|both] [--requests 64] [--threads 2]

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

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import hf_attn_patch  # noqa: F401
from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.models.pretrained import load_default, load_smollm2

CORPORA = Path(__file__).resolve().parents[2] / "shared" / "corpora"


def workload(tokenizer, text_file: str, n: int, max_prompt: int, max_out: int, seed: int = 0):
    """[(prompt ids, output length)] with lengths uniform in [16, max]."""
    ids = tokenizer(Path(CORPORA / text_file).read_text(encoding="utf-8")[:400_000]).input_ids
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(16, max_prompt)
        start = rng.randrange(0, len(ids) - length)
        out.append((ids[start : start + length], rng.randint(16, max_out)))
    return out


def summary(name, tokens, seconds, ttft, tpot, itl=None) -> dict:
    ttft, tpot = np.array(ttft) * 1000, np.array(tpot) * 1000
    extra = {} if itl is None else {"itl50": np.percentile(np.array(itl) * 1000, 50),
                                    "itl99": np.percentile(np.array(itl) * 1000, 99)}  # fmt: skip
    return {**extra, "name": name, "tok/s": tokens / seconds, "seconds": seconds, "ttft": ttft, "tpot": tpot,
            "ttft50": np.percentile(ttft, 50), "ttft99": np.percentile(ttft, 99),
            "tpot50": np.percentile(tpot, 50), "tpot99": np.percentile(tpot, 99)}  # fmt: skip


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
    config = GenerationConfig(max_new_tokens=max(n for _, n in requests), do_sample=False, eos_token_id=None,
                              pad_token_id=0)  # fmt: skip
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
        model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in group), do_sample=False,
                       eos_token_id=None, pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))  # fmt: skip
        for _, n in group:  # request i's tokens are ready at step n (it waits for the batch to finish)
            ttft.append(clock.times[0] - start)
            tpot.append((clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1))
    return time.perf_counter() - start, ttft, tpot


def table(rows, baseline: str) -> None:
    base = next(r for r in rows if r["name"] == baseline)["tok/s"]
    itl = all("itl99" in r for r in rows)
    print("| system | tok/s | vs " + baseline + " | TTFT p50 / p99 ms | TPOT p50 / p99 ms |"
          + (" inter-token p50 / p99 ms |" if itl else ""))  # fmt: skip
    print("|---|---|---|---|---|" + ("---|" if itl else ""))
    for r in rows:
        print(f"| {r['name']} | {r['tok/s']:.1f} | {r['tok/s'] / base:.2f}x | {r['ttft50']:.0f} / {r['ttft99']:.0f} | "
              f"{r['tpot50']:.1f} / {r['tpot99']:.1f} |"
              + (f" {r['itl50']:.1f} / {r['itl99']:.1f} |" if itl else ""))  # fmt: skip


def bench(label, model, tok, text_file, n, max_prompt, max_out, rate, plots):
    tok.pad_token = tok.pad_token or tok.eos_token
    requests = workload(tok, text_file, n, max_prompt, max_out)
    tokens = sum(k for _, k in requests)
    # max_model_len: stories260k was trained on 512 positions; its RoPE runs on (as generate() lets it) to 1024 + 256
    options = dict(max_batch_tokens=256, block_size=16, max_memory=256 * 1024 * 1024, max_model_len=max_prompt + max_out)
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
        seconds, ttft, tpot, engine = run_ours(model, tok, requests, arrivals, chunked_prefill=chunked,
                                               prefill_chunk=64, **options)  # fmt: skip
        online.append(summary(f"ours, chunked prefill {'on (64)' if chunked else 'off'}", tokens, seconds, ttft, tpot,
                              engine.inter_token_gaps))  # fmt: skip
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["stories", "smollm2", "both"], default="both")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plots = []
    if args.model in ("stories", "both"):
        model, tok = load_default()
        bench("stories260k", model, tok, "tinystories_sample.txt", args.requests, 1024, 256, 8.0, plots)
    if args.model in ("smollm2", "both"):
        model, tok = load_smollm2()
        bench("SmolLM2-135M", model, tok, "wikitext2_test.txt", max(8, args.requests // 2), 512, 128, 1.0, plots)
    plot(plots, Path(__file__).with_suffix(".png"))


if __name__ == "__main__":
    main()
