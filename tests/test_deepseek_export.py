"""--format deepseek_v3: a stock DeepseekV3ForCausalLM that loads without the patch, with exact RoPE frequencies and
interleaving, and a measured (not exact) latent norm."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch
from hf_attn_patch.attention import MultiHeadLatentAttention
from hf_attn_patch.converters.calibration import calibration_windows, collect_stats, read_calibration_text
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.deepseek_export import Q_SCALE, flashmla_fit, stock_frequencies, to_deepseek_v3
from hf_attn_patch.converters.exact import rebuild, stock_attention_layers
from hf_attn_patch.converters.methods import mla_layer
from hf_attn_patch.models.architectures import architecture_of

from .conftest import STORIES_ATOL, tiny_model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_export_loads_in_stock_transformers_and_matches_the_patched_load(tmp_path):
    report = convert("default", tmp_path / "ds", to="mla", kv_budget=0.5, format="deepseek_v3", calib_samples=4)
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["first_k_dense_replace"] == config["num_hidden_layers"]
    assert config["num_key_value_heads"] == config["num_attention_heads"] and config["rope_interleave"] is True
    assert isinstance(config["n_routed_experts"], int) and "attention_variant" not in config
    # llama.cpp asserts n_expert_groups < n_expert (a dense model has no groups) and needs a q_lora_rank
    assert config["n_group"] is None and config["topk_group"] is None
    assert config["q_lora_rank"] == config["hidden_size"]
    q_lora = report["deepseek_v3"]["q_lora"]
    assert q_lora["extra_parameters"] == 5 * (64 * 64 + 64)  # q_a_proj + q_a_layernorm, 5 layers of hidden 64
    assert 0 <= q_lora["kl_to_q_proj_per_token"] < 1e-6  # measured 4e-10: the factor sqrt(1 + eps / ms(h)) only
    assert report["deepseek_v3"]["flashmla"]["fits"] is False  # kv_lora_rank 24, rope 8: not FlashMLA's 512 + 64
    saved = json.loads((tmp_path / "ds" / "conversion_report.json").read_text())
    assert saved["engines"]["llama.cpp"].startswith("tested") and "in theory only" in saved["engines"]["vLLM / SGLang"]
    card = (tmp_path / "ds" / "README.md").read_text()
    assert "| llama.cpp | tested" in card and "do not fit vLLM's FlashMLA kernel (kv_lora_rank 24 + qk_rope_head_dim 8" in card
    assert "adds 20,800 parameters (7.3%)" in card
    assert report["format"] == "deepseek_v3" and report["deepseek_v3"]["exact"] is False
    # not a rounding bound: the stock latent norm is fitted, not exact; 0.2 caps a regression at ~4x the measured KL
    assert 0 < report["deepseek_v3"]["kl_to_native_per_token"] < 0.2  # measured 0.054 (stories260k, 50%)
    assert report["kv_bytes_per_token_fp16"] == {"before": 640, "after": 320}
    with hf_attn_patch.unpatched():
        stock = AutoModelForCausalLM.from_pretrained(tmp_path / "ds").eval()
    assert type(stock.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"
    assert type(stock.model.layers[-1].mlp).__name__ == "DeepseekV3MLP"
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ds").eval()  # patched: our MLA module, same numbers
    assert isinstance(ours.model.layers[0].self_attn, MultiHeadLatentAttention)
    ids = torch.randint(3, 500, (2, 40))
    # same weights, our module vs DeepSeek's own: only the fp32 summation order differs (stories260k: STORIES_ATOL)
    torch.testing.assert_close(logits(ours, ids), logits(stock, ids), atol=STORIES_ATOL, rtol=0)


def test_frequencies_and_interleaving_are_exact_without_the_norm(stories):
    """Stride-2 frequencies (0, 2) with the norm replaced by identity: stock DeepSeek equals the native conversion, so
    everything but the latent norm (rope_theta', interleaved rows, scaling, MLP and norms mapping) is exact."""
    model, tokenizer = stories
    windows = calibration_windows(read_calibration_text(None), tokenizer, 4, 64)
    stats = collect_stats(model, windows, progress=False)
    arch = architecture_of(model.config)
    lifted, fields = {}, {}
    for name, m in stock_attention_layers(model).items():
        lifted[name], fields = mla_layer("calibrated", arch.split_heads(m), model.config, stats[name], 16, 4,
                                         frequencies=[0, 2])  # fmt: skip
    native = rebuild(model, "mla", {**fields, "mla_rope_pairs": [[0, 2]] * 5}, lifted)
    exported, report = to_deepseek_v3(native, windows, stride=2)
    assert report["rope_frequencies"] == [0, 2]
    scales = report["latent_scale_per_layer"]
    assert all(s == 2.0 ** round(math.log2(s)) for s in scales)  # powers of two: the scaling itself is exact
    with hf_attn_patch.unpatched():
        stock = AutoModelForCausalLM.from_config(exported.config).eval()
        stock.load_state_dict(exported.state_dict())
        for i, layer in enumerate(stock.model.layers):  # the native latent, unnormalized, and its own up-projection
            attn = layer.self_attn
            attn.kv_a_layernorm = Scale(1 / scales[i])
            attn.kv_b_proj.weight.data = native.state_dict()[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
            # the query LoRA without its norm: g * (Q_SCALE u) / Q_SCALE = g * u = the source's normed input x
            attn.q_a_layernorm = Scale(attn.q_a_layernorm.weight.data / Q_SCALE)
        ids = torch.randint(3, 500, (1, 50))
        torch.testing.assert_close(logits(stock, ids), logits(native, ids), atol=1e-4, rtol=0)


class Scale(torch.nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def test_stride_choice():
    from hf_attn_patch.converters.mla_lift import RopeComponent

    scores = [5.0, 0.1, 4.0, 0.1, 3.0, 0.1, 0.1, 0.1]
    ranked = sorted(((s, RopeComponent.pair(0, i, 1)) for i, s in enumerate(scores)), key=lambda x: -x[0])
    assert stock_frequencies([ranked, ranked], 8, 3) == ([0, 2, 4], 2)
    assert stock_frequencies([ranked], 8, 1) == ([0], 1)
    with pytest.raises(ValueError, match="rope_dim=18: format='deepseek_v3' keeps one component per frequency"):
        convert("default", "unused", to="mla", kv_lora_rank=8, rope_dim=18, format="deepseek_v3")


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("gpt2", {}, "llama-family source"),
        ("llama", {"attention_bias": True}, "attention_bias=True"),
        ("mistral", {}, "sliding_window=5"),
    ],
)
def test_sources_stock_deepseek_cannot_express_are_refused(tmp_path, model_type, overrides, message):
    from hf_attn_patch.models.pretrained import DEFAULT_MODEL_DIR

    tiny_model(model_type, **overrides).save_pretrained(tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "src" / name).write_text((DEFAULT_MODEL_DIR / name).read_text())
    with pytest.raises(ValueError, match=message):
        convert(str(tmp_path / "src"), tmp_path / "out", to="mla", kv_budget=0.5, format="deepseek_v3")
    assert not (tmp_path / "out").exists()


def test_deepseek_format_needs_mla(tmp_path):
    with pytest.raises(ValueError, match="format='deepseek_v3' is an MLA export"):
        convert("default", tmp_path / "out", to="gqa", kv_heads=2, format="deepseek_v3")


def test_engines_per_format():
    from hf_attn_patch.converters.hub import engines

    flash = lambda d_c, d_r: {"deepseek_v3": {"flashmla": flashmla_fit(d_c, d_r)}}  # noqa: E731
    fits = engines({"format": "deepseek_v3", "model_type": "llama", **flash(512, 64)})["vLLM / SGLang"]
    assert "in theory only" in fits and "fit vLLM's FlashMLA kernel (kv_lora_rank 512" in fits
    assert "do not fit" in engines({"format": "deepseek_v3", "model_type": "llama", **flash(512, 32)})["vLLM / SGLang"]
    stock = engines({"format": "stock", "model_type": "llama"})
    assert stock["llama.cpp"].startswith("tested") and stock["transformers"].startswith("tested")
    assert engines({"format": "stock", "model_type": "qwen2"})["llama.cpp"].startswith("in theory")
    assert engines({"format": "native", "model_type": "gpt2"})["llama.cpp"].startswith("no:")
