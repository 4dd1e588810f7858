"""What the patch puts in transformers for building models (installed by _patching.py, which restores the originals).

- `attention_dispatch(original, architecture)`: the stand-in put under a stock attention class's name
  (`LlamaAttention`, ...). Decoder layers look the class up by name when a model is built; transformers has no
  registry for attention *modules* (AttentionInterface swaps only the kernel). A config carrying
  `attention_variant` (and any DeepSeek-V2/V3 config, see Architecture.replaces_stock) gets our
  GroupedQueryAttention / MultiHeadLatentAttention; every other model the stock class.
- `validating_post_init(original)`: `PreTrainedConfig.__post_init__` that validates `attention_variant` and its
  fields, so a bad config.json fails naming the field before any weight is loaded.
"""

from __future__ import annotations

from ..compat import constructor_signature
from . import build_attention, validate_variant_config


class AttentionDispatch(type):
    """Metaclass of the stand-in put under a stock attention class's name.

    Calling the stand-in builds ours when the config asks for a variant and the stock class otherwise;
    isinstance / issubclass checks against it answer as the stock class would (GPT-2's weight init uses them).
    """

    def __call__(cls, config, *args, **kwargs):
        if getattr(config, "attention_variant", None) is None and not cls.architecture.replaces_stock:
            return cls.original(config, *args, **kwargs)
        bound = cls.signature.bind(None, config, *args, **kwargs).arguments
        if bound.get("is_cross_attention"):  # GPT-2 cross-attention is not self-attention: keep it stock
            return cls.original(config, *args, **kwargs)
        return build_attention(config, bound.get("layer_idx"))

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.original)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, cls.original)

    def __repr__(cls) -> str:
        return f"<hf_attn_patch dispatch for {cls.original.__module__}.{cls.original.__qualname__}>"


def attention_dispatch(original: type, architecture) -> type:
    """The stand-in for `original` (a stock attention class) of `architecture` (a models.Architecture row)."""
    namespace = {
        "original": original,
        "architecture": architecture,
        "signature": constructor_signature(original),
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
    }
    return AttentionDispatch(original.__name__, (), namespace)


def validating_post_init(original):
    def __post_init__(self, **kwargs):
        original(self, **kwargs)
        if getattr(self, "attention_variant", None) is not None:
            validate_variant_config(self)

    __post_init__.__wrapped__ = original
    return __post_init__
