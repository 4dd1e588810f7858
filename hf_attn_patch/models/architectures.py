"""Per-architecture glue, as one table: where the stock attention class lives, how its config reads, and how to
take its weights apart. Adding an architecture is one `Architecture(...)` row, not a copy of a module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..attention.rope import DYNAMIC_ROPE_TYPES, rope_table, rotary_dim  # noqa: F401  (re-exported here)
from ..attention.spec import AttentionSpec
from ..variants import is_variant, native_variant, variant_of
from ..kv_memory import head_dim  # noqa: F401  (config sizes; re-exported here)


@dataclass
class AttentionWeights:
    """One stock attention layer in nn.Linear layout (out_features x in_features), heads contiguous.

    q_w [H*d_h, D], k_w / v_w [H_kv*d_h, D], o_w [D, H*d_h]; biases None where the layer has none;
    q_norm / k_norm: per-head RMSNorm weights [d_h] (qwen3) or None. `scaling` is the source's softmax scale.
    """

    q_w: torch.Tensor
    k_w: torch.Tensor
    v_w: torch.Tensor
    o_w: torch.Tensor
    q_b: torch.Tensor | None
    k_b: torch.Tensor | None
    v_b: torch.Tensor | None
    o_b: torch.Tensor | None
    scaling: float
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None

    def cpu(self) -> "AttentionWeights":
        """The same weights on the CPU (the converters' closed forms run there, in float64)."""
        moved = {name: value.cpu() if torch.is_tensor(value) else value for name, value in vars(self).items()}
        return AttentionWeights(**moved)

    def gqa_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict of a GroupedQueryAttention with the same heads."""
        out = {}
        for name in ("q", "k", "v", "o"):
            out[f"{name}_proj.weight"] = getattr(self, f"{name}_w")
            if getattr(self, f"{name}_b") is not None:
                out[f"{name}_proj.bias"] = getattr(self, f"{name}_b")
        if self.q_norm is not None:
            out["q_norm.weight"], out["k_norm.weight"] = self.q_norm, self.k_norm
        return out


def _linear(m: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return m.weight.detach(), None if m.bias is None else m.bias.detach()


def _split_heads_llama(attn) -> AttentionWeights:
    (q_w, q_b), (k_w, k_b), (v_w, v_b), (o_w, o_b) = map(_linear, (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    q_norm, k_norm = (None, None) if norms[0] is None else (norms[0].weight.detach(), norms[1].weight.detach())
    return AttentionWeights(q_w, k_w, v_w, o_w, q_b, k_b, v_b, o_b, attn.scaling, q_norm, k_norm)


def _split_heads_opt(attn) -> AttentionWeights:
    (q_w, q_b), (k_w, k_b), (v_w, v_b), (o_w, o_b) = map(
        _linear, (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)
    )
    return AttentionWeights(q_w, k_w, v_w, o_w, q_b, k_b, v_b, o_b, attn.scaling)


def _split_heads_gpt2(attn) -> AttentionWeights:
    # Conv1D stores weight as [in, out]; c_attn's out is [q | k | v].
    w, b = attn.c_attn.weight.detach().t(), attn.c_attn.bias.detach()
    (q_w, k_w, v_w), (q_b, k_b, v_b) = w.chunk(3, dim=0), b.chunk(3, dim=0)
    o_w, o_b = attn.c_proj.weight.detach().t(), attn.c_proj.bias.detach()
    return AttentionWeights(q_w, k_w, v_w, o_w, q_b, k_b, v_b, o_b, attn.scaling)


def _split_heads_gpt_neox(attn) -> AttentionWeights:
    # query_key_value's out is per head [q_h | k_h | v_h], head after head.
    d, hidden = attn.head_size, attn.query_key_value.in_features
    w = attn.query_key_value.weight.detach().view(-1, 3, d, hidden)
    q_w, k_w, v_w = (w[:, i].reshape(-1, hidden) for i in range(3))
    b = attn.query_key_value.bias
    q_b = k_b = v_b = None
    if b is not None:
        b = b.detach().view(-1, 3, d)
        q_b, k_b, v_b = (b[:, i].reshape(-1) for i in range(3))
    o_w, o_b = _linear(attn.dense)
    return AttentionWeights(q_w, k_w, v_w, o_w, q_b, k_b, v_b, o_b, attn.scaling)


def _no_split(attn) -> AttentionWeights:
    raise ValueError(f"{type(attn).__name__} is already latent attention: there are no K/V heads to take apart")


def _gpt2_scaling(config, layer_idx: int, head_dim: int) -> float:
    scaling = head_dim**-0.5 if config.scale_attn_weights else 1.0
    return scaling / (layer_idx + 1) if config.scale_attn_by_inverse_layer_idx else scaling


def _deepseek_mla_scaling(config, layer_idx: int, qk_head_dim: int) -> float:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    return yarn_apply_mscale(config.rope_parameters, qk_head_dim**-0.5)


def _layer_sliding_window(config, layer_idx: int) -> int | None:
    """Mistral: every layer; Qwen2/3: layers typed 'sliding_attention'."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and layer_types[layer_idx] != "sliding_attention"):
        return None
    return window


@dataclass(frozen=True)
class Architecture:
    """How one transformers model family is wired. Callables take the model's config."""

    model_type: str
    modeling_module: str  # where the stock attention class is looked up at model construction
    attention_class: str
    split_heads: Callable[[nn.Module], AttentionWeights]
    biases: Callable[[object], tuple[bool, bool, bool, bool]]  # (q, k, v, o)
    rotary: bool = True
    qk_norm: bool = False
    norm_eps: Callable[[object], float] = lambda c: getattr(c, "rms_norm_eps", 1e-6)
    scaling: Callable[[object, int, int], float] = lambda c, layer_idx, d: d**-0.5
    mla_scaling: Callable[[object, int, int], float] = lambda c, layer_idx, d: d**-0.5
    sliding_window: Callable[[object, int], int | None] = lambda c, layer_idx: None
    dropout: Callable[[object], float] = lambda c: float(getattr(c, "attention_dropout", 0.0) or 0.0)
    variants: tuple[str, ...] | None = None  # the attention variants it takes (None: every registered one)
    # Build ours even without `attention_variant` (same weights, same cache layout): DeepSeek-V3 gains absorbed
    # decoding over its latent cache, which transformers' own module lacks.
    replaces_stock: bool = False
    rope_interleave: bool | None = None  # None: read config.rope_interleave; DeepSeek-V2 always interleaves

    def attention_module(self):
        return importlib.import_module(self.modeling_module)


def _attention_bias(c):
    return (c.attention_bias,) * 4


def _deepseek_biases(c):
    """DeepSeek's q_proj / kv_b_proj never have a bias; q_a_proj, kv_a_proj and o_proj follow attention_bias."""
    return (c.attention_bias and c.q_lora_rank is not None,) + (c.attention_bias,) * 3


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in [
        Architecture(
            "llama", "transformers.models.llama.modeling_llama", "LlamaAttention", _split_heads_llama, _attention_bias
        ),
        Architecture(
            "mistral",
            "transformers.models.mistral.modeling_mistral",
            "MistralAttention",
            _split_heads_llama,
            lambda c: (False,) * 4,
            sliding_window=_layer_sliding_window,
        ),
        Architecture(
            "qwen2",
            "transformers.models.qwen2.modeling_qwen2",
            "Qwen2Attention",
            _split_heads_llama,
            lambda c: (True, True, True, False),
            sliding_window=_layer_sliding_window,
        ),
        Architecture(
            "qwen3",
            "transformers.models.qwen3.modeling_qwen3",
            "Qwen3Attention",
            _split_heads_llama,
            _attention_bias,
            qk_norm=True,
            sliding_window=_layer_sliding_window,
        ),
        Architecture(
            "gpt2",
            "transformers.models.gpt2.modeling_gpt2",
            "GPT2Attention",
            _split_heads_gpt2,
            lambda c: (True,) * 4,
            rotary=False,
            norm_eps=lambda c: c.layer_norm_epsilon,
            scaling=_gpt2_scaling,
            dropout=lambda c: c.attn_pdrop,
        ),
        Architecture(
            "gpt_neox",
            "transformers.models.gpt_neox.modeling_gpt_neox",
            "GPTNeoXAttention",
            _split_heads_gpt_neox,
            _attention_bias,
            norm_eps=lambda c: c.layer_norm_eps,
        ),
        Architecture(
            "opt",
            "transformers.models.opt.modeling_opt",
            "OPTAttention",
            _split_heads_opt,
            lambda c: (c.enable_bias,) * 4,
            rotary=False,
            norm_eps=lambda c: 1e-5,
        ),
        # Stock DeepSeek builds its latent norms with the RMSNorm default eps (1e-6), not rms_norm_eps.
        Architecture(
            "deepseek_v3",
            "transformers.models.deepseek_v3.modeling_deepseek_v3",
            "DeepseekV3Attention",
            _no_split,
            _deepseek_biases,
            mla_scaling=_deepseek_mla_scaling,
            variants=("mla",),
            replaces_stock=True,
            norm_eps=lambda c: 1e-6,
        ),
        # DeepSeek-V2 hands attention a complex freqs_cis and rotates interleaved pairs; otherwise V3's layout.
        Architecture(
            "deepseek_v2",
            "transformers.models.deepseek_v2.modeling_deepseek_v2",
            "DeepseekV2Attention",
            _no_split,
            _deepseek_biases,
            mla_scaling=_deepseek_mla_scaling,
            variants=("mla",),
            replaces_stock=True,
            rope_interleave=True,
            norm_eps=lambda c: 1e-6,
        ),
    ]
}


def architecture_of(config) -> Architecture:
    try:
        return ARCHITECTURES[config.model_type]
    except KeyError:
        raise ValueError(
            f"model_type={config.model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        ) from None


def attention_spec(config, layer_idx: int = 0) -> AttentionSpec:
    """The AttentionSpec of layer `layer_idx` (its variant's subclass) of a config carrying `attention_variant`.

    A DeepSeek-V2/V3 config is MLA by construction; without `attention_variant` it reads as variant 'mla'.
    """
    arch = architecture_of(config)
    variant = getattr(config, "attention_variant", None) or native_variant(config.model_type)
    if variant is None:
        raise ValueError(f"config of model_type={config.model_type!r} has no attention_variant")
    if is_variant(variant) and arch.variants is not None and variant not in arch.variants:
        raise ValueError(f"attention_variant={variant!r} is not available for model_type={arch.model_type!r}")
    kind = variant_of(variant)  # raises naming an unknown variant
    heads, d_h = config.num_attention_heads, head_dim(config)
    q_bias, k_bias, v_bias, o_bias = arch.biases(config)
    common = dict(
        variant=variant,
        hidden_size=config.hidden_size,
        num_attention_heads=heads,
        head_dim=d_h,
        rotary_dim=rotary_dim(config) if arch.rotary else 0,
        q_bias=q_bias,
        k_bias=k_bias,
        v_bias=v_bias,
        o_bias=o_bias,
        qk_norm=arch.qk_norm,
        norm_eps=arch.norm_eps(config),
        sliding_window=arch.sliding_window(config, layer_idx),
        dropout=arch.dropout(config),
    )
    return kind.spec(**common, **kind.spec_fields(config, layer_idx, arch, common))


def rope_frequencies(config) -> tuple[float, ...]:
    """theta_i (radians per position) of each RoPE pair i < d_rot/2, as the model's rotary embedding computes them
    (empty without RoPE)."""
    if not architecture_of(config).rotary:
        return ()
    return rope_table(config)[0]


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention as its config says, read once (the converters pass it instead of the config): the
    family's Architecture, head dim d_h, RoPE dims per head d_rot (0 without RoPE) and their frequencies, query and
    KV heads, decoder layers, hidden size D, and which of q, k, v, o have a bias."""

    arch: Architecture
    head_dim: int
    rotary_dim: int
    heads: int
    kv_heads: int
    layers: int
    hidden: int
    biases: tuple[bool, bool, bool, bool]
    frequencies: tuple[float, ...]

    @property
    def half(self) -> int:
        """RoPE pairs per head, d_rot / 2."""
        return self.rotary_dim // 2

    @classmethod
    def of(cls, config) -> AttentionShape:
        arch = architecture_of(config)
        return cls(
            arch,
            head_dim(config),
            rotary_dim(config) if arch.rotary else 0,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            config.num_hidden_layers,
            config.hidden_size,
            tuple(arch.biases(config)),
            rope_frequencies(config),
        )
