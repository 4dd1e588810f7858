"""What every exact re-expression of a stock model shares (each target's exact form is its `exact` hook,
converters/targets/; `targets.exact.to_variant` runs it): the stock attention layers of a model, and the new model
rebuilt with a variant's config fields and the re-expressed layers."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...attention import MultiHeadLatentAttention
from ...models.architectures import architecture_of


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
