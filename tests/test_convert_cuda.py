"""The converter on a CUDA GPU (skipped without one; scripts/gpu_check.sh runs it): the model passes run on the
device, the closed forms on the CPU, and the result is as good as the CPU's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_attn_patch.converters.io.calibration import read_calibration_text
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.evaluation.perplexity import evaluate, windows_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# the CLI's defaults: teacher samples, sensitivity budgets (MLA with a budget), reconstruction by the KV share kept
DEFAULTS = dict(calib_source="teacher", reconstruct_steps="auto")


@pytest.mark.parametrize("options", [dict(to="mla", kv_budget=0.5), dict(to="mqa", heal_steps=5),
                                     dict(to="mla", kv_budget=0.5, format="deepseek_v3", heal_steps=5)],
                         ids=["mla-sensitivity", "mqa-healed", "deepseek_v3-healed"])  # fmt: skip
def test_a_cuda_conversion_is_as_good_as_the_cpu_one(stories, tmp_path, options):
    source, tokenizer = stories
    held_out = windows_of(read_calibration_text(None)[-40_000:], tokenizer, ctx=256, max_tokens=1024)
    kl = {}
    for device in ("cuda", "cpu"):
        report = convert("default", tmp_path / device, device=device, **DEFAULTS, **options)
        assert report["options"]["device"] == device
        model = AutoModelForCausalLM.from_pretrained(tmp_path / device)
        kl[device] = evaluate(model, held_out, source, progress=False).kl_to_reference
    # the GPU samples other teacher tokens (other rounding in the logits) and sums in another order: the result
    # moves either way, as a new seed would, but a device bug (a layer left unfitted, a wrong closed form) would
    # leave the closed form's KL, 2-3x the reconstructed one's on stories260k (BENCHMARKS)
    assert kl["cuda"] < 1.3 * kl["cpu"], kl
