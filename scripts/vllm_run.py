"""vLLM on saved checkpoints, run by the python of vLLM's own venv (scripts/vllm_env.sh builds it): it imports
neither hf_attn_patch nor anything of the package's venv, and speaks JSON both ways.

    build/vllm-venv/bin/python scripts/vllm_run.py JOBS.json OUT.json

JOBS.json: a list of jobs, each {"name", "model", "engine": {vllm.LLM keyword arguments}, "requests": [{"ids":
prompt token ids, "max_tokens": n}]} -> prompt logprobs of every prompt token after the first and the greedy
continuation (temperature 0). Every job loads its model once (a vLLM load takes about a minute on two cores); jobs
run one after the other in this one process.

    build/vllm-venv/bin/python scripts/vllm_run.py --bench MODEL ENGINE_JSON

loads MODEL once, then answers batches on stdin, one JSON line each, {"prompts": [ids, ...], "max_tokens": n}, with
one line "RESULT {json}" on stdout: wall seconds, generated tokens, per-request time to first token and mean
inter-token latency (vLLM's request metrics), so a caller can interleave its own runs with vLLM's
(scripts/bench_vs_vllm.py). The first line "READY {json}" gives the KV pool (blocks and block size;
VLLM_CPU_KVCACHE_SPACE GiB in all) and the step's token budget (max_num_batched_tokens).
vLLM spawns its engine process, hence the __main__ guard.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def score(llm, requests: list[dict]) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = []
    for req in requests:
        params = SamplingParams(
            max_tokens=req["max_tokens"],
            min_tokens=req["max_tokens"],
            temperature=0.0,
            prompt_logprobs=0,
            detokenize=False,
            ignore_eos=True,
        )
        got = llm.generate([TokensPrompt(prompt_token_ids=req["ids"])], params, use_tqdm=False)[0]
        ids = req["ids"]  # prompt_logprobs[i]: {token id: Logprob} for position i (None at 0)
        logprobs = [got.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        out.append({"prompt_logprobs": logprobs, "greedy": list(got.outputs[0].token_ids)})
    return out


def batch(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts submitted at once, each generating exactly max_tokens (greedy, EOS ignored)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft, itl = [], []
    for o in outs:  # engine-core timestamps (monotonic), from vLLM's per-request stats
        m, n = o.metrics, len(o.outputs[0].token_ids)
        ttft.append(m.first_token_latency)
        itl.append((m.last_token_ts - m.first_token_ts) / max(1, n - 1))
    return {"wall_s": wall, "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "ttft_s": ttft, "itl_s": itl}


def serve_bench(model: str, engine: dict) -> None:
    from vllm import LLM

    llm = LLM(model=model, disable_log_stats=False, **engine)  # log stats: the per-request metrics
    config = llm.llm_engine.vllm_config
    ready = {
        "num_blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
    }
    print("READY " + json.dumps(ready), flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        print("RESULT " + json.dumps(batch(llm, spec["prompts"], spec["max_tokens"])), flush=True)


def main() -> None:
    from vllm import LLM

    if sys.argv[1] == "--bench":
        serve_bench(sys.argv[2], json.loads(sys.argv[3]))
        return
    jobs = json.load(open(sys.argv[1]))
    results = []
    for job in jobs:
        start = time.perf_counter()
        llm = LLM(model=job["model"], **job.get("engine", {}))
        result = {"name": job["name"], "load_s": time.perf_counter() - start}
        result["requests"] = score(llm, job["requests"])
        results.append(result)
        print(f"vllm_run: {job['name']} done (load {result['load_s']:.0f} s)", flush=True)
        del llm
        gc.collect()
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
