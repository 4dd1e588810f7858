"""Tiny configs of every supported architecture (real values in comments), shared by the tests."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_attn_patch  # noqa: F401  (the patch is what is under test)
from hf_attn_patch.models.pretrained import load_default


# fp32 rounding bounds of the exactness tests. Two fp32 computations of one function that differ only in summation
# order (or by an exact re-expression) drift apart by about eps (1.2e-7) x sqrt(K) per reduction of K terms,
# accumulated over the layers and scaled by the size of the result:
#   tiny configs below (hidden <= 64, 2 layers, |logits| <= 1): 1.2e-7 x 8 x 2 x 1, with a 5x margin ~ 1e-5
#   stories260k (hidden 64, 5 layers, |logits| <= 20):          1.2e-7 x 8 x 5 x 20 ~ 1e-4
TINY_ATOL = 1e-5
STORIES_ATOL = 1e-4


def tiny_config(model_type: str, **overrides):
    """Shrunk configs with odd sizes where the architecture allows them."""
    common = dict(vocab_size=97, num_hidden_layers=2)
    kw = {
        # Llama-2-7B: hidden 4096, 32 heads (MHA), head_dim 128; Llama-3-8B: 8 KV heads
        "llama": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, head_dim=8),
        # Mistral-7B-v0.1: 32 heads, 8 KV heads, sliding window 4096
        "mistral": dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=3,
                        head_dim=8, sliding_window=5),
        # Qwen2.5-7B: 28 heads, 4 KV heads, q/k/v bias
        "qwen2": dict(hidden_size=56, intermediate_size=64, num_attention_heads=7, num_key_value_heads=1),
        # Qwen3-8B: 32 heads, 8 KV heads, head_dim 128, q/k RMSNorm
        "qwen3": dict(hidden_size=40, intermediate_size=64, num_attention_heads=5, num_key_value_heads=1, head_dim=12),
        # GPT-2: n_embd 768, 12 heads (MHA), learned positions, fused Conv1D c_attn
        "gpt2": dict(n_embd=36, n_head=6, n_layer=2, n_positions=64),
        # Pythia-1B: hidden 2048, 8 heads, rotary_pct 0.25, fused per-head qkv
        "gpt_neox": dict(hidden_size=40, intermediate_size=64, num_attention_heads=5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5}),
        # OPT-125m: hidden 768, 12 heads (MHA), learned positions, biases
        "opt": dict(hidden_size=36, ffn_dim=48, num_attention_heads=6, word_embed_proj_dim=36,
                    max_position_embeddings=64),
        # DeepSeek-V3: hidden 7168, 128 heads, kv_lora_rank 512, q_lora_rank 1536, rope 64, nope 128, v 128
        "deepseek_v3": dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
                            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                            qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=4, num_experts_per_tok=2,
                            n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1),
    }  # fmt: skip
    kw["deepseek_v2"] = {**kw["deepseek_v3"], "topk_method": "greedy"}  # DeepSeek-V2: same attention shapes
    kw = kw[model_type]
    if model_type == "gpt2":
        common = dict(vocab_size=97)
    return transformers.AutoConfig.for_model(model_type, **{**common, **kw, **overrides})


def tiny_model(model_type: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    _randomize_norms(model)
    return model.eval()


def _randomize_norms(model) -> None:
    """Norm weights start at 1 and biases at 0: perturb them so a dropped norm or bias cannot go unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)


@pytest.fixture
def padded_batch():
    """Left-padded ragged batch: row 0 has 3 pads, row 1 none."""
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = 0
    return ids, mask


@pytest.fixture(scope="module")
def stories():
    """The embedded stories260k (model, tokenizer), loaded once per test module."""
    return load_default()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread while decoding tiny models: as fast, and immune to oversubscription when the 2 cores are
    shared (two threads made the grammar tests ~50x slower under load). The previous setting is restored."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
