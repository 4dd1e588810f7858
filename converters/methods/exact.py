"""Exact re-expression of a stock model with our attention modules: same function, new parameterization.

- GQA: the source's own heads (H_kv = H for MHA sources) in GroupedQueryAttention.
- MLA (TransMLA's observation made exact): every RoPE pair of every KV head in the decoupled key, the latent spanning
  the stacked non-RoPE K and V exactly (see mla_lift.py). Scores and outputs equal the source's up to rounding; the
  lossy conversions (pooling, truncated bases, RoPE selection) are the same construction with less kept.
- latent K/V: full ranks (G * d_h each, at most the hidden size): A_k = W_k, B_k = I, A_v = W_v, o_proj with the
  identity up-projection of V folded in (latent_kv.py with every component kept).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...attention import MultiHeadLatentAttention
from ...models.architectures import AttentionShape, architecture_of
from .latent_kv import latent_kv_layer
from .mla_lift import all_pairs, lift_mla


def to_variant(model: nn.Module, variant: str) -> nn.Module:
    """A new model computing the same function as `model` with attention_variant `variant` ("gqa" | "mla" |
    "latent_kv").

    The source model is not modified. Needs the patch (import hf_attn_patch) so the new config builds our modules.
    """
    shape = AttentionShape.of(model.config)
    arch = shape.arch
    layers = stock_attention_layers(model, allow_ours=variant == "mla" and arch.replaces_stock)
    if variant == "gqa":
        lifted = {name: arch.split_heads(m).gqa_state_dict() for name, m in layers.items()}
        fields = {"num_key_value_heads": next(iter(lifted.values()))["k_proj.weight"].shape[0] // shape.head_dim}
    elif variant == "mla" and arch.replaces_stock:  # DeepSeek: already MLA, same parameter names
        lifted, fields = {name: m.state_dict() for name, m in layers.items()}, {}
    elif variant == "latent_kv":
        lifted = {}
        for name, m in layers.items():
            weights = arch.split_heads(m)
            rank = weights.k_w.shape[0]
            if rank > shape.hidden:
                raise ValueError(f"latent_kv's exact form needs num_key_value_heads*head_dim={rank} <= "
                                 f"hidden_size={shape.hidden}")  # fmt: skip
            cov = torch.eye(shape.hidden + 1, dtype=torch.float64)  # any full-rank input: the fit is exact
            lifted[name] = latent_kv_layer(weights, shape, cov, rank, rank, context=1)
        fields = {"latent_key_rank": rank, "latent_value_rank": rank,
                  "num_key_value_heads": rank // shape.head_dim}  # fmt: skip
    elif variant == "mla":
        lifted, fields = {}, {}
        for name, m in layers.items():
            weights = arch.split_heads(m)
            kv_heads = weights.k_w.shape[0] // shape.head_dim
            lifted[name], fields = lift_mla(weights, shape, all_pairs(shape, kv_heads), None)
    else:
        raise ValueError(f"variant={variant!r} is not one of ('gqa', 'mla', 'latent_kv')")
    return rebuild(model, variant, fields, lifted)


def stock_attention_layers(model: nn.Module, allow_ours: bool = False) -> dict[str, nn.Module]:
    """{module name: stock attention module} in layer order (raises if there are none)."""
    arch = architecture_of(model.config)
    layers = {name: m for name, m in model.named_modules() if type(m).__name__ == arch.attention_class}
    if not layers and allow_ours:  # DeepSeek built while patched: our module already
        layers = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadLatentAttention)}
    if not layers:
        raise ValueError(f"no {arch.attention_class} layers found: is the model already converted?")
    return layers


def rebuild(model: nn.Module, variant: str, fields: dict, lifted: dict[str, dict[str, torch.Tensor]]) -> nn.Module:
    """A new model: `model`'s config plus attention_variant and `fields`, its weights with the attention layers
    replaced by `lifted` ({layer module name: state dict}). Validates the config; the source is not touched."""
    from transformers import AutoModelForCausalLM

    from ... import is_patched

    if not is_patched():
        raise RuntimeError("converting needs the patch: call hf_attn_patch.patch() first")
    config = copy.deepcopy(model.config)
    config.attention_variant = variant
    for key, value in fields.items():
        setattr(config, key, value)
    config = type(config).from_dict(config.to_dict())  # rebuild: validates the variant fields
    new = AutoModelForCausalLM.from_config(
        config, dtype=next(model.parameters()).dtype, attn_implementation=model.config._attn_implementation
    )
    state = {k: v for k, v in model.state_dict().items() if not any(k.startswith(n + ".") for n in lifted)}
    for name, sd in lifted.items():
        state.update({f"{name}.{k}": v for k, v in sd.items()})
    new.load_state_dict(state, strict=True)
    new.to(next(model.parameters()).device)  # built on the CPU: where the source runs, the conversion runs
    new.generation_config = copy.deepcopy(model.generation_config)
    return new.eval() if not model.training else new
