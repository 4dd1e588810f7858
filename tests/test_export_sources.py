"""--format deepseek_v3 from the sources users have: full-rank conversions of random-weight configs reproduce the
source's logits in stock transformers (plain and llama3-scaled RoPE), the nearest RoPE is reported when llama3's
scaling changes a kept frequency, and what stock DeepSeek-V3 cannot express is refused by name before any work."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch
from hf_attn_patch.converters.convert import convert

from .conftest import tiny_model
from .test_deepseek_export import source_folder

# llama3 scaling with Llama-3.1's factors; original_max_position_embeddings sets the bands: wavelengths below
# orig / high_freq_factor are unchanged. d_rot 8, theta 1e4: wavelengths 6.3, 63, 628, 6283.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
UNCHANGED = {**LLAMA3, "original_max_position_embeddings": 1_000_000}  # every frequency in the unchanged band
SCALED = {**LLAMA3, "original_max_position_embeddings": 64}  # 63 smoothed, 628 and 6283 divided by 8


def mqa_source(tmp_path, **overrides):
    """A random 2-layer llama with one KV head (6 query heads of 8): one RoPE component per frequency is all of
    them and a latent of rank 8 spans [K_nope; V], so the deepseek_v3 export can be exact."""
    model = tiny_model("llama", vocab_size=512, num_key_value_heads=1, **overrides)
    return model, source_folder(tmp_path / "src", model)


def export(src, out, **options):
    return convert(
        str(src),
        out,
        to="mla",
        kv_lora_rank=8,
        rope_dim=8,
        format="deepseek_v3",
        calib_samples=4,
        calib_len=64,
        calib_source="text",
        reconstruct_steps=0,
        **options,
    )


def stock_logits(folder, ids):
    with hf_attn_patch.unpatched(), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"
        return model(ids).logits


@pytest.mark.parametrize("engine", ["llama.cpp", "transformers"])
@pytest.mark.parametrize("rope", [None, UNCHANGED], ids=["default", "llama3-unchanged-band"])
def test_full_rank_export_reproduces_the_source(tmp_path, rope, engine):
    long = {"max_position_embeddings": 2_000_000}  # above original_max_position_embeddings, as transformers wants
    model, src = mqa_source(tmp_path, **({"rope_parameters": rope, **long} if rope else {}))
    report = export(src, tmp_path / "ds", engine=engine)["deepseek_v3"]
    assert report["exact"] is True and report["rope"]["exact"] is True
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "default" and config["rms_norm_eps"] == 1e-6
    ids = torch.randint(3, 500, (2, 40))
    with torch.no_grad():
        expected = model(ids).logits
    # fp32 rounding through 2 layers of random weights (logits ~1): the latent / query norms' deviation from linear
    # is 2^-31 relative, the eps change exact (residual rescale)
    torch.testing.assert_close(stock_logits(tmp_path / "ds", ids), expected, atol=2e-5, rtol=0)


def test_llama3_scaled_frequencies_take_the_nearest_stock_rope(tmp_path):
    model, src = mqa_source(tmp_path, rope_parameters=SCALED)
    report = export(src, tmp_path / "ds")
    rope = report["deepseek_v3"]["rope"]
    assert rope["exact"] is False and report["deepseek_v3"]["exact"] is False and rope["rope_type"] == "llama3"
    # theta' fitted to log inverse frequencies bent by a factor 8: the worst of 4 is off by a factor ~3 (measured 2.15)
    assert 0.05 < rope["max_relative_frequency_error"] < 10
    assert report["deepseek_v3"]["kl_to_native_per_token"] > 0  # measured, not hidden (random weights: 3e-8)
    ids = torch.randint(3, 500, (1, 60))
    with torch.no_grad():
        off = float((stock_logits(tmp_path / "ds", ids) - model(ids).logits).abs().max())
    assert off > 2e-5  # beyond the exact cases' rounding bound (test above)
    assert "nearest stock frequencies, largest relative error" in (tmp_path / "ds" / "README.md").read_text()


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("qwen2", {}, "'qwen2' has q/k/v biases; a query bias adds q-dependent terms"),
        ("qwen3", {}, "'qwen3' has per-head q/k norms \\(QK-norm\\)"),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "rope_type='yarn'",
        ),
        ("llama", {"mlp_bias": True}, "mlp_bias=True"),
        ("gpt_neox", {}, "llama-family source"),
    ],
)
def test_sources_refused_by_name_before_any_work(tmp_path, model_type, overrides, message):
    src = source_folder(tmp_path / "src", tiny_model(model_type, **overrides))
    with pytest.raises(ValueError, match=message):
        convert(str(src), tmp_path / "out", to="mla", kv_budget=0.5, format="deepseek_v3")
    assert not (tmp_path / "out").exists()
