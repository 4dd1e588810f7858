"""The converted decoder layer that holds one layer's closed form (the closed forms themselves are the targets':
converters/targets/), and the typed per-layer choices and results the stages pass around."""

from __future__ import annotations

import torch
from torch import nn

from ..targets.base import LatentChoice, LayerChoice, LayerResult, converted_config  # noqa: F401  (used by the stages)


def build_layer(source_layer: nn.Module, index: int, config, attn_name: str, attn_state: dict) -> nn.Module:
    """The converted decoder layer `index` (transformers' class, our attention module by config.attention_variant):
    the source layer's weights with its attention replaced by attn_state, in the source layer's dtype and device.
    Built on the meta device and given its tensors: no initialization runs (nor draws from the global RNG)."""
    param = next(source_layer.parameters())
    with torch.device("meta"):
        layer = type(source_layer)(config, index)
    if any(True for _ in layer.buffers()):
        raise ValueError(f"{type(layer).__name__} has buffers, which a converted layer cannot be given")
    state = {k: v for k, v in source_layer.state_dict().items() if not k.startswith(attn_name + ".")}
    state.update({f"{attn_name}.{k}": v for k, v in attn_state.items()})
    state = {k: v.to(device=param.device, dtype=param.dtype) for k, v in state.items()}
    layer.load_state_dict(state, strict=True, assign=True)
    return layer.eval().requires_grad_(False)
