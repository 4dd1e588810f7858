"""Attention modules: GQA (MHA and MQA are its two ends), DeepSeek multi-head latent attention, and latent K/V
attention (low-rank keys and values taken before RoPE). Each variant registers itself (variants.py) when its module
is imported here: a new variant is its module and one import line."""

from .base import VariantAttention
from .gqa import GroupedQueryAttention, eager_attention
from .mla import MultiHeadLatentAttention
from .latent_kv import LatentKVAttention
from .spec import AttentionSpec
from ..variants import Variant, variant_names, variant_of

VARIANTS = variant_names()  # ("gqa", "mla", "latent_kv")

__all__ = [
    "AttentionSpec",
    "GroupedQueryAttention",
    "LatentKVAttention",
    "MultiHeadLatentAttention",
    "VARIANTS",
    "Variant",
    "VariantAttention",
    "eager_attention",
    "variant_names",
    "variant_of",
]
