"""VariantAttention: the base of every attention variant's module. It owns what transformers and the engine see of
a layer: the forward signature (the cache under any of the names transformers has passed it by, resolved once by
compat.attention_cache), the check that the spec is this variant's, and the engine route (the packed forward of an
engine step, read from the forward context). A variant writes `layer_forward()` for its own math."""

from __future__ import annotations

import torch
from torch import nn

from ..cache.metadata import get_forward_context
from ..compat import attention_cache
from .spec import AttentionSpec
from ..variants import variant_of


class VariantAttention(nn.Module):
    variant: str  # the registry name (variants.py) of the subclass

    def __init__(self, config, layer_idx: int, spec: AttentionSpec):
        super().__init__()
        if spec.variant != self.variant:
            raise ValueError(f"{type(self).__name__} needs attention_variant={self.variant!r}, got {spec.variant!r}")
        self.config = config  # read at call time: set_attn_implementation() may change it after construction
        self.layer_idx = layer_idx
        self.spec = spec

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,  # the cache's name before transformers 5.24
        layer_past=None,  # GPT-NeoX passes the cache under this name
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = attention_cache(cache, past_key_values, layer_past)
        return self.layer_forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)

    def layer_forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
        raise NotImplementedError

    def engine_forward(self, *tensors: torch.Tensor) -> torch.Tensor | None:
        """Inside an engine step's packed forward: the variant's paged forward (variants.py) on this
        layer's new tensors (it writes them into the pages and attends over them); None otherwise. A variant without
        one (GQA) reaches the pages through the attention function the engine registers instead."""
        context = get_forward_context()
        if context is None or not context.route:
            return None
        return variant_of(self.variant).paged_forward(self, *tensors, context)
