"""The one place that changes transformers. Every replaced object is recorded so unpatch() puts it back exactly.

What is replaced, and why no official hook does it:
- `<Arch>Attention` in each supported modeling module (see models.architectures.ARCHITECTURES): decoder layers look
  the class up by name when a model is built, so a dispatcher standing under that name gives a model whose config
  carries `attention_variant` our GroupedQueryAttention / MultiHeadLatentAttention, and any other model the stock
  class. transformers has no registry for attention *modules* (AttentionInterface swaps only the kernel).
- `PreTrainedConfig.__post_init__`: validates `attention_variant` and its fields when a config is built, so a bad
  config.json fails naming the field before any weight is loaded.
"""

from __future__ import annotations

import inspect
import logging

from transformers.configuration_utils import PreTrainedConfig

logger = logging.getLogger(__name__)

# (id(owner), name) -> (owner, name, original object)
_originals: dict[tuple[int, str], tuple[object, str, object]] = {}


def _replace(owner, name: str, new) -> None:
    key = (id(owner), name)
    if key not in _originals:
        _originals[key] = (owner, name, vars(owner)[name])
    setattr(owner, name, new)


class AttentionDispatch:
    """Stands under a stock attention class's name: builds ours when the config asks for a variant."""

    def __init__(self, original: type, model_type: str):
        self.original = original
        self.model_type = model_type
        self._signature = inspect.signature(original.__init__)
        self.__name__ = original.__name__
        self.__qualname__ = original.__qualname__
        self.__doc__ = original.__doc__

    def __call__(self, config, *args, **kwargs):
        if getattr(config, "attention_variant", None) is None:
            return self.original(config, *args, **kwargs)
        bound = self._signature.bind(None, config, *args, **kwargs).arguments
        if bound.get("is_cross_attention"):  # GPT-2 cross-attention is not self-attention: keep it stock
            return self.original(config, *args, **kwargs)
        from .models import build_attention

        return build_attention(config, bound.get("layer_idx"))

    def __repr__(self) -> str:
        return f"<hf_attn_patch dispatch for {self.original.__module__}.{self.original.__qualname__}>"


def _validating_post_init(original):
    def __post_init__(self, **kwargs):
        original(self, **kwargs)
        if getattr(self, "attention_variant", None) is not None:
            from .models import validate_variant_config

            validate_variant_config(self)

    __post_init__.__wrapped__ = original
    return __post_init__


def patch() -> None:
    """Install the patch (idempotent)."""
    if _originals:
        return
    from .models import ARCHITECTURES

    for arch in ARCHITECTURES.values():
        module = arch.attention_module()
        _replace(module, arch.attention_class, AttentionDispatch(getattr(module, arch.attention_class), arch.model_type))
    _replace(PreTrainedConfig, "__post_init__", _validating_post_init(vars(PreTrainedConfig)["__post_init__"]))
    logger.debug("hf_attn_patch: patched %d objects", len(_originals))


def unpatch() -> None:
    """Put every replaced object back (idempotent). Models built while patched keep their modules."""
    for owner, name, original in _originals.values():
        setattr(owner, name, original)
    _originals.clear()


def is_patched() -> bool:
    return bool(_originals)


def patched_objects() -> list[tuple[object, str, object]]:
    """(owner, name, original) for everything currently replaced; for tests and debugging."""
    return list(_originals.values())
