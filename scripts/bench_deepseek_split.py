"""Uniform latent / RoPE splits of the deepseek_v3 export against the native per-layer (sensitivity) conversion, at
one KV budget: KL to the source on the calibration windows (what a choice may use) and perplexity / KL on held-out
TinyStories text (the sample after its first 100,000 characters). Closed forms (text calibration, no
reconstruction). Prints one JSON line per conversion.

    python scripts/bench_deepseek_split.py $DATA/models/stories15m 0.5 $DATA/corpora/tinystories_sample.txt 16 32 48
"""

from __future__ import annotations

import json
import sys
import tempfile

from transformers import AutoModelForCausalLM

import hf_attn_patch  # noqa: F401 - loads the native conversions
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.models.pretrained import load_source
from hf_attn_patch.evaluation.perplexity import evaluate, windows_of


def main() -> None:
    source, budget, text_file, *rope_dims = sys.argv[1:]
    model, tokenizer = load_source(source)
    calib = calibration_windows(read_calibration_text(None), tokenizer, 8, 256)
    held_out = windows_of(open(text_file, encoding="utf-8").read()[100_000:], tokenizer, 256, 256 * 8)
    runs = [("native sensitivity", dict(rank_allocation="sensitivity"))]
    runs += [(f"deepseek_v3 d_r {r}", dict(format="deepseek_v3", rope_dim=int(r))) for r in rope_dims]
    for name, options in runs:
        with tempfile.TemporaryDirectory() as tmp:
            convert(source, f"{tmp}/out", to="mla", kv_budget=float(budget), calib_samples=8, calib_source="text",
                    reconstruct_steps=0, **options)  # fmt: skip
            converted = AutoModelForCausalLM.from_pretrained(f"{tmp}/out").eval()
        held = evaluate(converted, held_out, reference=model, progress=False)
        print(json.dumps({"run": name, "calib_kl": evaluate(converted, calib, reference=model, progress=False)
                          .kl_to_reference, "held_out_ppl": held.perplexity, "held_out_kl": held.kl_to_reference}),
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
