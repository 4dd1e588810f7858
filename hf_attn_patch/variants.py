"""The attention variants, one entry each: the door a new variant comes in by.

A variant's module (gqa.py, mla.py, latent_kv.py) declares, in one `register(Variant(...))` at its end:

- `module`: its attention class (a `VariantAttention`: the base owns the forward signature, the cache prologue and
  the engine route);
- `spec`: its AttentionSpec subclass, the fields its module reads beside the common ones, checked in `check()`
  (errors name the config field), and `spec_fields(config, layer_idx, arch, common)`: those fields from a config;
- `cache_spec(config, layer_idx)`: a CacheSpec, what one layer caches per token and how the paged storage lays it
  out, which the KV accounting (kv_memory.py), PagedKVCache and the engine's paged storage read;
- `paged_forward`: the function the engine's packed forward attends with (None: the registered attention function,
  through transformers' attention interface, as for GQA);
- `trainable(module)`: the parameters healing trains;
- `latent_factors(module)`: its latent factor pairs (down, latent rows of down, up, latent blocks in up's input),
  which healing rebalances before training (converters/fitting/balance.py; none for GQA);
- `native_model_types`: the transformers model types whose attention is this variant by construction (DeepSeek's
  is MLA), read so without `attention_variant`; `mha_values(config)`: values per token the same layer would cache
  as full MHA, the accounting's baseline (None: 2 * H * d_h of the config's heads).

The formats a conversion can write are its target's (converters/targets/), not the variant's.

attention/__init__.py imports each variant module, which registers it; everything else looks variants up here by
name (`variant_of(config.attention_variant)`) instead of comparing names. This module imports nothing of the package,
so the layers below attention (kv_memory, cache) may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# A config without attention_variant (a stock model) is read as this variant.
STOCK_VARIANT = "gqa"


def _all_parameters(module) -> list:
    return list(module.parameters())


def _no_factors(module) -> list:
    return []


@dataclass(frozen=True)
class CacheSpec:
    """What one attention layer caches per token, and its paged storage layout.

    kind: the accounting's name ("mha", "gqa", "mqa", "mla", ...); heads: heads stored per token (1 for a latent);
    key_dim, value_dim: the sizes of the two tensors the layer writes (value_dim 0: the key row is all it caches);
    fused: both in one row per token, [key | value] (a latent decode kernel reads a token's row at once), else keys
    and values apart (cache/kv_storage.py)."""

    kind: str
    heads: int
    key_dim: int
    value_dim: int
    fused: bool = False

    @property
    def values_per_token(self) -> int:
        return self.heads * (self.key_dim + self.value_dim)


@dataclass(frozen=True)
class Variant:
    name: str
    module: type
    spec: type  # its AttentionSpec subclass (attention/spec.py)
    spec_fields: Callable  # (config, layer_idx, arch, common: dict) -> dict of the spec's own fields
    cache_spec: Callable  # (config, layer_idx) -> CacheSpec: what one layer caches per token, and its layout
    paged_forward: Callable | None = None
    trainable: Callable = _all_parameters  # (module) -> the parameters healing trains
    latent_factors: Callable = _no_factors  # (module) -> [(down Linear, rows slice, up Linear, blocks)]
    native_model_types: tuple[str, ...] = ()
    mha_values: Callable | None = None  # (config) -> values per token as MHA; None: 2 * H * d_h


_REGISTRY: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    if variant.name in _REGISTRY and _REGISTRY[variant.name] is not variant:
        raise ValueError(f"attention variant {variant.name!r} is registered twice")
    _REGISTRY[variant.name] = variant
    return variant


def variant_names() -> tuple[str, ...]:
    """The registered variants, in registration order ("gqa", "mla", "latent_kv")."""
    return tuple(_REGISTRY)


def native_variant(model_type: str) -> str | None:
    """The variant a model type's own attention is (DeepSeek-V2/V3: "mla"), None for the stock kind."""
    return next((v.name for v in _REGISTRY.values() if model_type in v.native_model_types), None)


def config_variant(config) -> Variant:
    """The variant of a config's attention layers: its attention_variant, its model type's native one, else GQA."""
    name = getattr(config, "attention_variant", None) or native_variant(config.model_type) or STOCK_VARIANT
    return variant_of(name)


def is_variant(name) -> bool:
    return name in _REGISTRY


def variant_of(name: str) -> Variant:
    """The registered variant `name`; a ValueError naming it and the choices otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"attention_variant={name!r} is not one of {variant_names()}") from None
