"""KV-cache byte accounting for any supported config, from the config alone (no weights, no model).

Per attention layer and token the cache holds
    MHA / GQA / MQA   2 * H_kv * d_h values             (keys and values of the H_kv heads)
    MLA               kv_lora_rank + qk_rope_head_dim   (the latent c_t and the shared RoPE key)
    latent K/V        latent_key_rank + latent_value_rank (the pre-RoPE latents c_k, c_v)
Sliding-window layers keep the last `sliding_window - 1` tokens between steps (the current token completes the
window; transformers' DynamicSlidingWindowLayer). Linear-attention and SSM layers of hybrid models keep a
constant state per sequence (a conv window and a recurrent state), whatever the length. Each formula below was
checked against the tensors transformers' own DynamicCache holds after a forward (tests/test_kv_memory.py).
One dtype is applied to every value; models that keep SSM states in fp32 under fp16 weights hold more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .variants import CacheSpec, config_variant


def head_dim(config) -> int:
    """Per-head size: the config's head_dim where it has one, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float8": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn, "int8": torch.int8,
}  # fmt: skip

# Layer types (config.layer_types) whose cache grows with the sequence, or is constant, or is absent.
_ATTENTION_TYPES = ("full_attention", "sliding_attention")
_STATE_TYPES = ("linear_attention", "conv")
_NO_CACHE_TYPES = ("mlp", "moe")


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer caches for one sequence."""

    # "mha" | "gqa" | "mqa" | "mla" | "latent_kv" | "state" | "none" (+ "+state" for hybrid attention+SSM layers)
    kind: str
    values_per_token: int  # values cached per token (0 for pure state layers)
    window: int | None = None  # at most this many tokens are kept (sliding attention)
    state_values: int = 0  # constant values per sequence (conv + recurrent state)
    mha_values_per_token: int = 0  # what the same layer would cache per token as full MHA
    spec: CacheSpec | None = None  # attention layers: the variant's cache spec (what it writes, the storage layout)


def dtype_of(dtype) -> torch.dtype:
    """torch.dtype from a dtype or a name ('fp16', 'bfloat16', ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype={dtype!r} is not a torch.dtype or one of {sorted(_DTYPES)}")


def layer_caches(config) -> list[LayerCache]:
    """One LayerCache per decoder layer of `config` (a text config, or a multimodal one holding it)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        window = getattr(config, "sliding_window", None)  # e.g. Mistral-7B-v0.1: every layer slides
        layer_types = ["sliding_attention" if window else "full_attention"] * n_layers
    out = []
    for layer_idx, layer_type in enumerate(layer_types):
        if layer_type in _NO_CACHE_TYPES:
            out.append(LayerCache("none", 0))
        elif layer_type in _STATE_TYPES:
            out.append(LayerCache("state", 0, state_values=_state_values(config, layer_type)))
        elif layer_type in _ATTENTION_TYPES or layer_type == "hybrid":
            spec, mha = _attention_spec(config, layer_idx)
            window = config.sliding_window - 1 if layer_type == "sliding_attention" else None
            state = _state_values(config, "linear_attention") if layer_type == "hybrid" else 0
            out.append(
                LayerCache(spec.kind + ("+state" if state else ""), spec.values_per_token, window, state, mha, spec)
            )
        else:
            raise ValueError(f"layer type {layer_type!r} of model_type={config.model_type!r} is not supported")
    return out


def kv_cache_bytes(config, seq_len: int, batch_size: int = 1, dtype=torch.float16) -> int:
    """Bytes of KV cache (all layers) for `batch_size` sequences of `seq_len` tokens each."""
    _check_sizes(seq_len, batch_size)
    size = torch.empty((), dtype=dtype_of(dtype)).element_size()
    values = sum(
        (seq_len if layer.window is None else min(seq_len, layer.window)) * layer.values_per_token + layer.state_values
        for layer in layer_caches(config)
    )
    return values * batch_size * size


def mha_cache_bytes(config, seq_len: int, batch_size: int = 1, dtype=torch.float16) -> int:
    """The same model with every attention layer as full MHA over the whole sequence (the ratio's baseline)."""
    _check_sizes(seq_len, batch_size)
    size = torch.empty((), dtype=dtype_of(dtype)).element_size()
    values = sum(seq_len * layer.mha_values_per_token + layer.state_values for layer in layer_caches(config))
    return values * batch_size * size


def _check_sizes(seq_len, batch_size) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 0:
        raise ValueError(f"seq_len={seq_len!r} must be a non-negative integer")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")


def layer_cache_specs(config) -> list[CacheSpec | None]:
    """Per decoder layer its CacheSpec (None for a layer without a per-token cache)."""
    return [layer.spec for layer in layer_caches(config)]


def _attention_spec(config, layer_idx: int) -> tuple[CacheSpec, int]:
    """(the CacheSpec, values per token as MHA) of attention layer `layer_idx`: its variant's (variants.py); the
    baseline of a converted model is its source's heads."""
    variant = config_variant(config)
    mha = variant.mha_values(config) if variant.mha_values else 2 * config.num_attention_heads * head_dim(config)
    return variant.cache_spec(config, layer_idx), mha


def _state_values(config, layer_type: str) -> int:
    """Constant per-sequence state of one linear-attention / SSM / conv layer: conv window + recurrent state."""
    c = config
    if layer_type == "conv":  # LFM2 short convolution
        return c.hidden_size * c.conv_L_cache
    if hasattr(c, "linear_num_value_heads"):  # Gated DeltaNet (Qwen3-Next, Qwen3.5)
        conv_dim = (
            2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        )
        recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        return conv_dim * c.linear_conv_kernel_dim + recurrent
    if hasattr(c, "mamba_n_heads"):  # Mamba-2 mixers (Bamba, GraniteMoeHybrid, Falcon-H1)
        inner = getattr(c, "mamba_d_ssm", None) or c.mamba_expand * c.hidden_size
        return _mamba2(inner, c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv)
    if hasattr(c, "mamba_num_heads"):  # Nemotron-H
        inner = c.mamba_num_heads * c.mamba_head_dim
        return _mamba2(inner, c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel)
    if c.model_type == "mamba2":
        return _mamba2(c.expand * c.hidden_size, c.num_heads, c.head_dim, c.n_groups, c.state_size, c.conv_kernel)
    if hasattr(c, "mamba_d_state"):  # Mamba-1 mixers (Jamba)
        inner = c.mamba_expand * c.hidden_size
        return inner * (c.mamba_d_conv + c.mamba_d_state)
    if c.model_type in ("mamba", "falcon_mamba"):
        return c.intermediate_size * (c.conv_kernel + c.state_size)
    raise ValueError(f"{layer_type!r} layers of model_type={c.model_type!r} are not supported by kv_cache_bytes")


def _mamba2(inner: int, heads: int, head_dim: int, groups: int, state: int, conv_kernel: int) -> int:
    return (inner + 2 * groups * state) * conv_kernel + heads * head_dim * state


def llama3_8b_configs() -> dict:
    """A worked example: the Llama-3-8B shape (d=4096, H=32, d_h=128, 32 layers) as MHA, MQA, GQA-8 and MLA."""
    from transformers import LlamaConfig

    shape = dict(hidden_size=4096, num_attention_heads=32, head_dim=128, num_hidden_layers=32, intermediate_size=14336)
    mla = dict(attention_variant="mla", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    return {
        "MHA (H_kv=32)": LlamaConfig(**shape, num_key_value_heads=32),
        "MQA (H_kv=1)": LlamaConfig(**shape, num_key_value_heads=1),
        "GQA (H_kv=8)": LlamaConfig(**shape, num_key_value_heads=8),
        "MLA (d_c=512, d_r=64)": LlamaConfig(**shape, num_key_value_heads=32, **mla),
    }


def kv_report(configs: dict, seq_len: int, batch_size: int = 1, dtype=torch.float16) -> str:
    """A text table: per config, bytes per token per attention layer, total bytes and the ratio to MHA."""
    size = torch.empty((), dtype=dtype_of(dtype)).element_size()
    lines = [
        f"seq_len={seq_len:,}  batch_size={batch_size}  dtype={str(dtype_of(dtype)).replace('torch.', '')}",
        f"{'model':<26}{'layers':>7}  {'kind':<10}{'B/token/layer':>14}{'total bytes':>20}{'total GB':>10}"
        f"{'MHA GB':>10}{'x MHA':>8}",
    ]
    for name, config in configs.items():
        layers = layer_caches(config)
        kinds = sorted({layer.kind for layer in layers}, key=[layer.kind for layer in layers].index)
        per_token = sorted({layer.values_per_token * size for layer in layers if layer.values_per_token})
        total, mha = (
            kv_cache_bytes(config, seq_len, batch_size, dtype),
            mha_cache_bytes(config, seq_len, batch_size, dtype),
        )
        lines.append(
            f"{name:<26}{len(layers):>7}  {'/'.join(kinds):<10}{'/'.join(map(str, per_token)) or '-':>14}"
            f"{total:>20,}{total / 1e9:>10.2f}{mha / 1e9:>10.2f}{total / mha if mha else float('nan'):>8.3f}"
        )
        windows = sorted({layer.window for layer in layers if layer.window})
        states = sorted({layer.state_values * size for layer in layers if layer.state_values})
        if windows:
            lines.append(f"{'':<26}sliding layers keep at most {'/'.join(map(str, windows))} tokens")
        if states:
            lines.append(f"{'':<26}constant state per sequence per state layer: {'/'.join(map(str, states))} B")
    return "\n".join(lines)
