"""Per-architecture glue (one table), attention construction from a config, and loading models (the bundled ones by
name, local folders, Hub ids)."""

from __future__ import annotations

from ..variants import variant_of
from .architectures import ARCHITECTURES, Architecture, AttentionWeights, architecture_of, attention_spec
from .pretrained import load_default, load_smollm2, load_source


def build_attention(config, layer_idx: int):
    """The attention layer a config with `attention_variant` asks for (validates the config first)."""
    spec = attention_spec(config, layer_idx)
    return variant_of(spec.variant).module(config, layer_idx, spec)


def validate_variant_config(config) -> None:
    """Raise ValueError naming the field and value if a config's attention variant fields are inconsistent."""
    for layer_idx in range(getattr(config, "num_hidden_layers", 1) or 1):
        attention_spec(config, layer_idx)


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "AttentionWeights",
    "architecture_of",
    "attention_spec",
    "build_attention",
    "load_default",
    "load_smollm2",
    "load_source",
    "validate_variant_config",
]
