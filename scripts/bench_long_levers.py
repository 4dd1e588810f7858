"""Long-context levers of an MLA conversion, each converted once into --keep/<lever> and then measured with
scripts/bench_long_context.py (held-in criterion, passage, passkey) like the source and the CLI default.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_long_levers.py --lever uniform_ds --keep /tmp/i40w
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_long_context.py --model "uniform_ds=/tmp/i40w/uniform_ds" \
        --texts wikitext --passkey 4096 --parts held_in,passage,passkey

Every lever states all its options (nothing rides on convert()'s defaults); MLA 50% of the source's KV bytes:
    uniform_ds   --format deepseek_v3 (one rank and RoPE split for all layers), teacher 32 x 256, reconstruction 60,
                 RoPE scored over L = 256: what the stock DeepSeek shape gives up against the per-layer default
    retrieval    native, --rank-allocation retrieval: the layers holding a copy head (measured on the source's own
                 samples, converters/methods/retrieval_heads.py) kept exact, the others share the rest uniformly;
                 otherwise as uniform_ds
    mixed        --calib-lengths 2048,1024,512,256,256: each calibration row packs teacher samples of these lengths
                 (positions restart per sample, attention stays within it), 2 rows = the default's 8,192 tokens;
                 uniform ranks, reconstruction 60, L = the source's context (as the 1,024-window recipe)
    recipe       the 1,024-window recipe of BENCHMARKS.md (teacher 8 x 1,024, uniform, reconstruction 60,
                 L = the source's context): the base the mixed lever changes one thing of
Teacher calibration samples are cached in --keep (safetensors), so levers with the same windows sample once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

import hf_attn_patch  # noqa: F401
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.stages import windows as windows_stage

MIXED = "2048,1024,512,256,256"  # --calib-lengths: one calibration window packs samples of these lengths
BASE = {"calib_source": "teacher", "calib_samples": 32, "calib_len": 256, "reconstruct_steps": 60,
        "reconstruct_attention_kl": 0.0, "rope_context": 256}  # fmt: skip
LEVERS = {
    "uniform_ds": {**BASE, "format": "deepseek_v3", "rank_allocation": "uniform"},
    "retrieval": {**BASE, "format": "native", "rank_allocation": "retrieval"},
    "mixed": {**BASE, "format": "native", "rank_allocation": "uniform", "calib_samples": 2, "calib_len": 4096,
              "calib_lengths": MIXED, "rope_context": 8192},  # fmt: skip
    "recipe": {**BASE, "format": "native", "rank_allocation": "uniform", "calib_samples": 8, "calib_len": 1024,
               "rope_context": 8192},  # fmt: skip
}
# the calibration-length lever on the closed form (text windows, uniform ranks, no reconstruction, L = the source's
# context): reconstruction on long windows costs O(T^2) per step, beyond a shared 2-core CPU's hour
CLOSED = {**BASE, "format": "native", "rank_allocation": "uniform", "calib_source": "text", "reconstruct_steps": 0,
          "rope_context": 8192}  # fmt: skip
LEVERS.update({"closed_256": CLOSED, "closed_1024": {**CLOSED, "calib_samples": 8, "calib_len": 1024},
               "closed_4096": {**CLOSED, "calib_samples": 2, "calib_len": 4096},
               "closed_mixed": {**CLOSED, "calib_samples": 2, "calib_len": 4096, "calib_lengths": MIXED},
               # the RoPE lever: decoupled RoPE dims against latent rank (default d_r 64 + d_c 128 per layer)
               "closed_rope32": {**CLOSED, "rope_dim": 32}, "closed_rope96": {**CLOSED, "rope_dim": 96}})  # fmt: skip

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2")
    parser.add_argument("--lever", required=True, choices=list(LEVERS))
    parser.add_argument("--keep", required=True, help="folder: the conversion goes to KEEP/<lever>")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep = Path(args.keep)
    spec = importlib.util.spec_from_file_location("levers", Path(__file__).with_name("bench_retrieval_levers.py"))
    levers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(levers)
    windows_stage.teacher_windows = levers.cached_samples(keep / "teacher_cache", windows_stage.teacher_windows)
    started = time.perf_counter()
    report = convert(args.source, keep / args.lever, to="mla", kv_budget=0.5, overwrite=True, **LEVERS[args.lever])
    print(json.dumps({"lever": args.lever, "wall_s": round(time.perf_counter() - started, 1),
                      "stages": report.get("stages"), "budgets": report.get("budgets", {}).get("layers")}), flush=True)


if __name__ == "__main__":
    main()
