"""stories15M (llama2.c, a real MHA checkpoint: 6 query heads, 6 KV heads, head_dim 48, Llama-2 SentencePiece vocab)
through every conversion: GQA 6->3 and 6->2, MQA, MLA at 50%, 25% and MQA's bytes (1/6), native and deepseek_v3.

Fast options (8 calibration windows of 128 tokens of the package corpus, closed form: no teacher sampling, no
reconstruction), evaluated on held-out TinyStories text (the last 40,000 characters of the corpus; calibration
reads its start). Each bound is the figure measured on this setup (MEASURED, one run, fp32 CPU) with a margin,
so a regression of the converter fails here. The CLI defaults do better (BENCHMARKS.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from hf_attn_patch.converters.io.calibration import read_calibration_text
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.models.pretrained import load_source
from hf_attn_patch.evaluation.perplexity import evaluate, windows_of

STORIES15M = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories15m"
pytestmark = pytest.mark.skipif(not STORIES15M.exists(), reason="../shared/models/stories15m not present")
FAST = dict(calib_samples=8, calib_len=128)
# target: (options, KV values kept of the source's 2 x 6 x 48 per layer, measured perplexity ratio, measured KL)
MEASURED = {
    "GQA 3": (dict(to="gqa", kv_heads=3), 1 / 2, 1.5902, 0.4687),
    "GQA 2": (dict(to="gqa", kv_heads=2), 1 / 3, 2.2081, 0.7922),
    "MQA": (dict(to="mqa"), 1 / 6, 3.8112, 1.3648),
    "MLA 50%": (dict(to="mla", kv_budget=0.5), 1 / 2, 1.1579, 0.1353),
    "MLA 50% deepseek_v3": (dict(to="mla", kv_budget=0.5, format="deepseek_v3"), 1 / 2, 1.1523, 0.1617),
    "MLA 25%": (dict(to="mla", kv_budget=0.25), 1 / 4, 2.0985, 0.7424),
    "MLA 25% deepseek_v3": (dict(to="mla", kv_budget=0.25, format="deepseek_v3"), 1 / 4, 2.4022, 0.8793),
    "MLA MQA bytes": (dict(to="mla", kv_budget=1 / 6), 1 / 6, 3.4735, 1.2121),
    "MLA MQA bytes deepseek_v3": (dict(to="mla", kv_budget=1 / 6, format="deepseek_v3"), 1 / 6, 3.8699, 1.3113),
}
# Margins: the conversion is deterministic (seed 0); what moves is fp32 summation order across BLAS builds and
# thread counts, which shifts a closed form's eigenvectors slightly. 3% of the perplexity ratio's excess over 1
# plus 0.02, and 10% on the KL, stay above that drift: a regression of a few percent fails.
RATIO_MARGIN, RATIO_SLACK, KL_MARGIN = 1.03, 0.02, 1.10


@pytest.fixture(scope="module")
def source():
    model, tokenizer = load_source(str(STORIES15M))
    held_out = windows_of(read_calibration_text(None)[-40_000:], tokenizer, ctx=256, max_tokens=2048)
    return model, held_out, evaluate(model, held_out, progress=False).perplexity


def test_source_is_a_real_mha_model(source):
    config = source[0].config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6, 6, 48)
    assert source[2] < 10  # held-out TinyStories perplexity of the real checkpoint (measured 7.97)


@pytest.mark.parametrize("target", list(MEASURED))
def test_conversion_quality_is_kept(source, target, tmp_path):
    options, kept, ratio, kl = MEASURED[target]
    model, held_out, base = source
    report = convert(str(STORIES15M), tmp_path / "out", **FAST, **options)
    assert kept * 0.9 < report["kv_ratio"] <= kept + 1e-9  # sensitivity allocation may leave a little unspent
    assert report["format"] == options.get("format", "stock" if options["to"] != "mla" else "native")
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    if "deepseek_v3" in target:
        assert converted.config.model_type == "deepseek_v3"
    result = evaluate(converted, held_out, reference=model, progress=False)
    assert result.perplexity / base <= 1 + (ratio - 1) * RATIO_MARGIN + RATIO_SLACK, (result.perplexity / base, ratio)
    assert result.kl_to_reference <= kl * KL_MARGIN, (result.kl_to_reference, kl)
