"""kv_cache_bytes against worked Llama-3-8B figures and against the tensors transformers' caches really hold."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import transformers

import hf_attn_patch
from hf_attn_patch.compat import get_cache
from hf_attn_patch.converters.targets.exact import to_variant
from hf_attn_patch.kv_memory import kv_cache_bytes, layer_caches, mha_cache_bytes, llama3_8b_configs

from .conftest import tiny_model


def test_llama3_8b_per_layer_per_token():
    per_token = {name: kv_cache_bytes(c, seq_len=1) // 32 for name, c in llama3_8b_configs().items()}
    assert list(per_token.values()) == [16384, 512, 4096, 1152]  # MHA, MQA, GQA, MLA in fp16


def test_llama3_8b_totals_are_the_true_arithmetic():
    configs = llama3_8b_configs()
    gqa, mha = configs["GQA (H_kv=8)"], configs["MHA (H_kv=32)"]
    # "32K context, 32 layers, batch 64: GQA 16.8 GB, MHA 67.1 GB", often quoted, holds for 32,000 tokens at batch 4.
    assert kv_cache_bytes(gqa, 32_000, batch_size=4) == 16_777_216_000
    assert kv_cache_bytes(mha, 32_000, batch_size=4) == 67_108_864_000
    assert kv_cache_bytes(gqa, 32_000, batch_size=64) == 268_435_456_000
    assert kv_cache_bytes(mha, 32_000, batch_size=64) == 1_073_741_824_000
    assert kv_cache_bytes(gqa, 32_000, 64, dtype=torch.float32) == 2 * 268_435_456_000
    assert kv_cache_bytes(gqa, 32_000, 64, dtype="bf16") == 268_435_456_000


def cache_bytes(cache) -> int:
    """Bytes of every tensor a transformers cache holds (attention K/V, conv and recurrent states)."""
    total = 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            if isinstance(states, dict):
                tensors += list(states.values())
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def measured(model, seq_len: int, batch: int = 2) -> int:
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (batch, seq_len))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(ids, use_cache=True)
    cache = get_cache(out) or out.get("cache_params")
    return cache_bytes(cache)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "opt", "deepseek_v3", "deepseek_v2", "mistral"])
def test_stock_caches(model_type):
    model = tiny_model(model_type)
    for seq_len in (3, 11):  # mistral's sliding window (5) binds at 11
        assert measured(model, seq_len) == kv_cache_bytes(model.config, seq_len, batch_size=2, dtype=torch.float32)


@pytest.mark.parametrize("model_type,variant", [("llama", "mla"), ("gpt2", "mla"), ("gpt2", "gqa")])
def test_variant_caches(model_type, variant):
    model = to_variant(tiny_model(model_type), variant)
    assert measured(model, 7) == kv_cache_bytes(model.config, 7, batch_size=2, dtype=torch.float32)


HYBRIDS = {  # tiny configs; real models: Qwen3-Next-80B, Bamba-9B, Granite-4.0-H, Falcon-H1, Jamba, LFM2, ...
    "Qwen3NextConfig": dict(hidden_size=32, intermediate_size=16, moe_intermediate_size=8,
                            shared_expert_intermediate_size=8, num_experts=2, num_experts_per_tok=1,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=6, linear_conv_kernel_dim=3),
    "BambaConfig": dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
                        mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=8, attn_layer_indices=[1]),
    "FalconH1Config": dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12,
                           mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=8),
    "Mamba2Config": dict(hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=2,
                         conv_kernel=3, expand=2, chunk_size=8),
    "MambaConfig": dict(hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=3, expand=2),
    "JambaConfig": dict(hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100,
                        expert_layer_offset=99, mamba_d_state=8, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=4,
                        num_experts=1),
    "Lfm2Config": dict(hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, conv_L_cache=3, layer_types=["conv", "full_attention", "conv"]),
    "NemotronHConfig": dict(hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2,
                            conv_kernel=3, expand=2, chunk_size=8, layers_block_type=["mamba", "attention", "mlp"]),
}  # fmt: skip


@pytest.mark.parametrize("config_class", sorted(HYBRIDS))
def test_hybrid_and_ssm_states_are_constant_and_exact(config_class):
    config = getattr(transformers, config_class)(vocab_size=100, **HYBRIDS[config_class])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert any(layer.state_values for layer in layer_caches(config))
    for seq_len in (5, 9):
        assert measured(model, seq_len) == kv_cache_bytes(config, seq_len, batch_size=2, dtype=torch.float32)


def test_bad_arguments_are_named():
    config = llama3_8b_configs()["GQA (H_kv=8)"]
    with pytest.raises(ValueError, match="seq_len=-1"):
        kv_cache_bytes(config, -1)
    with pytest.raises(ValueError, match="batch_size=0"):
        kv_cache_bytes(config, 8, batch_size=0)
    with pytest.raises(ValueError, match="dtype='fp13'"):
        kv_cache_bytes(config, 8, dtype="fp13")
    assert hf_attn_patch.kv_cache_bytes is kv_cache_bytes
    assert mha_cache_bytes(config, 10) == 4 * kv_cache_bytes(config, 10)


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_attn_patch.cli", *args], capture_output=True, text=True)


def test_kv_report_cli(tmp_path):
    result = run_cli("kv-report", "llama3-8b", "--seq-len", "32000", "--batch-size", "64")
    assert result.returncode == 0, result.stderr
    assert "268,435,456,000" in result.stdout and "1,073,741,824,000" in result.stdout
    assert " 1152 " in result.stdout and "0.070" in result.stdout
    config = to_variant(tiny_model("gpt_neox"), "mla").config
    config.save_pretrained(tmp_path)
    result = run_cli("kv-report", str(tmp_path / "config.json"), "--seq-len", "10", "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    assert f"{kv_cache_bytes(config, 10, dtype=torch.float32):,}" in result.stdout
    result = run_cli("kv-report", str(tmp_path / "missing"), "--seq-len", "10")
    assert result.returncode != 0 and "MODEL_OR_CONFIG=" in result.stderr
    result = run_cli("kv-report", "default", "--seq-len", "0")
    assert result.returncode != 0 and "0 is not a positive integer" in result.stderr
