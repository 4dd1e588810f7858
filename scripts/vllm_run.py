"""vLLM on saved checkpoints, run by the python of vLLM's own venv (scripts/vllm_env.sh builds it): it imports
neither hf_attn_patch nor anything of the package's venv, and speaks JSON both ways.

    build/vllm-venv/bin/python scripts/vllm_run.py JOBS.json OUT.json

JOBS.json: a list of jobs, each {"name", "model", "engine": {vllm.LLM keyword arguments}, then either
  "requests": [{"ids": prompt token ids, "max_tokens": n}]  -> prompt logprobs of every prompt token after the first
                                                              and the greedy continuation (temperature 0), or
  "bench": {"prompts": [ids, ...], "max_tokens": n, "batch_sizes": [1, 8, 32]}  -> offline throughput per batch
                                                              size, time to first token, inter-token latency}.
Every job loads its model once (a vLLM load takes about a minute on two cores); jobs run one after the other in
this one process. vLLM spawns its engine process, hence the __main__ guard.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time


def score(llm, requests: list[dict]) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = []
    for req in requests:
        params = SamplingParams(max_tokens=req["max_tokens"], min_tokens=req["max_tokens"], temperature=0.0,
                                prompt_logprobs=0, detokenize=False, ignore_eos=True)  # fmt: skip
        got = llm.generate([TokensPrompt(prompt_token_ids=req["ids"])], params, use_tqdm=False)[0]
        ids = req["ids"]  # prompt_logprobs[i]: {token id: Logprob} for position i (None at 0)
        logprobs = [got.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        out.append({"prompt_logprobs": logprobs, "greedy": list(got.outputs[0].token_ids)})
    return out


def bench(llm, spec: dict) -> dict:
    """Offline throughput (generated tokens / s) per batch size: `batch` requests submitted at once, each
    max_tokens long; time to first token and inter-token latency from vLLM's per-request metrics."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=spec["max_tokens"], min_tokens=spec["max_tokens"], temperature=0.0,
                            ignore_eos=True, detokenize=False)  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    rows = []
    for batch in spec["batch_sizes"]:
        chosen = [prompts[i % len(prompts)] for i in range(batch)]
        start = time.perf_counter()
        outs = llm.generate(chosen, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        ttft, itl = [], []
        for o in outs:
            m = getattr(o, "metrics", None)
            first = getattr(m, "first_token_latency", None) if m is not None else None
            if first is not None:
                ttft.append(first)
            last, first_ts = getattr(m, "last_token_ts", None), getattr(m, "first_token_ts", None)
            n = len(o.outputs[0].token_ids)
            if last is not None and first_ts is not None and n > 1:
                itl.append((last - first_ts) / (n - 1))
        rows.append({"batch": batch, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                     "ttft_s": statistics.median(ttft) if ttft else None,
                     "itl_s": statistics.median(itl) if itl else None})  # fmt: skip
    return {"rows": rows}


def main() -> None:
    from vllm import LLM

    jobs = json.load(open(sys.argv[1]))
    results = []
    for job in jobs:
        start = time.perf_counter()
        llm = LLM(model=job["model"], **job.get("engine", {}))
        result = {"name": job["name"], "load_s": time.perf_counter() - start}
        if "requests" in job:
            result["requests"] = score(llm, job["requests"])
        if "bench" in job:
            result["bench"] = bench(llm, job["bench"])
        results.append(result)
        print(f"vllm_run: {job['name']} done (load {result['load_s']:.0f} s)", flush=True)
        del llm
        gc.collect()
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
