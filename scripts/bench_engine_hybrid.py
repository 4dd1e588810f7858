"""Our Engine vs static batches of generate() on hybrid models (constant-state layers), in one process.

    .venv/bin/python scripts/bench_engine_hybrid.py [--requests 32] [--threads 1]

Models: small random-init LFM2 (short conv), Qwen3-Next (gated delta net) and Bamba (Mamba2), seeded, fp32, 4
layers (3 state layers + 1 attention), hidden 128 (no hybrid checkpoint is available offline; speed does not depend
on the weights). Workload (seeded): N requests, prompts of 16..64 random tokens, outputs of 16..48 tokens (EOS
ignored, so both sides produce exactly the same number of tokens). Greedy. Baseline: static batches of 8 with
generate() (FIFO, left-padded, each batch runs to its longest output). Prints tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import transformers

import hf_attn_patch
from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.models.pretrained import load_default

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, pad_token_id=0)  # fmt: skip
CONFIGS = {
    "lfm2": dict(layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3),
    "qwen3_next": dict(layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"], head_dim=32,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                       linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, shared_expert_intermediate_size=64),
    "bamba": dict(attn_layer_indices=[2], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=32,
                  mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16),
}  # fmt: skip


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(3, 512) for _ in range(rng.randint(16, 64))], rng.randint(16, 48)) for _ in range(n)]


def run_engine(model, tokenizer, requests) -> tuple[float, int]:
    engine = Engine(model, tokenizer, max_batch_tokens=256, block_size=16)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in requests]
    start = time.perf_counter()
    outputs = engine.generate([p for p, _ in requests], params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def run_static(model, requests, batch: int = 8) -> tuple[float, int]:
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        longest, new = max(len(p) for p, _ in chunk), max(m for _, m in chunk)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in chunk])
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        tokens += sum(m for _, m in chunk)  # the tokens the requests asked for (the rest of each row is waste)
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    tokenizer = load_default()[1]
    requests = workload(args.requests)
    print(f"hf_attn_patch {hf_attn_patch.__version__}, {args.requests} requests, {args.threads} thread(s)")
    print("| model | engine tok/s | static generate() tok/s | ratio |")
    print("|---|---|---|---|")
    for model_type, overrides in CONFIGS.items():
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **overrides})
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        run_engine(model, tokenizer, requests[:4])  # warm-up (first-call allocations)
        ours, ours_tokens = run_engine(model, tokenizer, requests)
        base, base_tokens = run_static(model, requests)
        ratio = (ours_tokens / ours) / (base_tokens / base)
        print(f"| {model_type} | {ours_tokens / ours:.1f} | {base_tokens / base:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
