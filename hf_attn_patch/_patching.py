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


class AttentionDispatch(type):
    """Metaclass of the stand-in put under a stock attention class's name.

    Calling the stand-in builds ours when the config asks for a variant and the stock class otherwise;
    isinstance / issubclass checks against it answer as the stock class would (GPT-2's weight init uses them).
    """

    def __call__(cls, config, *args, **kwargs):
        if getattr(config, "attention_variant", None) is None:
            return cls.original(config, *args, **kwargs)
        bound = cls.signature.bind(None, config, *args, **kwargs).arguments
        if bound.get("is_cross_attention"):  # GPT-2 cross-attention is not self-attention: keep it stock
            return cls.original(config, *args, **kwargs)
        from .models import build_attention

        return build_attention(config, bound.get("layer_idx"))

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.original)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, cls.original)

    def __repr__(cls) -> str:
        return f"<hf_attn_patch dispatch for {cls.original.__module__}.{cls.original.__qualname__}>"


def attention_dispatch(original: type) -> type:
    """The stand-in for `original` (a stock attention class)."""
    namespace = {
        "original": original,
        "signature": inspect.signature(original.__init__),
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
    }
    return AttentionDispatch(original.__name__, (), namespace)


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
        _replace(module, arch.attention_class, attention_dispatch(getattr(module, arch.attention_class)))
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
