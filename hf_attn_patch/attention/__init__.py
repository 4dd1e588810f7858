"""Attention modules: GQA (MHA and MQA are its two ends), DeepSeek multi-head latent attention, and latent K/V
attention (low-rank keys and values taken before RoPE)."""

from .gqa import GroupedQueryAttention, eager_attention
from .latent_kv import LatentKVAttention
from .mla import MultiHeadLatentAttention
from .spec import VARIANTS, AttentionSpec

__all__ = ["AttentionSpec", "GroupedQueryAttention", "LatentKVAttention", "MultiHeadLatentAttention", "VARIANTS", "eager_attention"]
