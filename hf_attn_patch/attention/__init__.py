"""Attention modules: GQA (MHA and MQA are its two ends) and DeepSeek multi-head latent attention."""

from .gqa import GroupedQueryAttention, eager_attention
from .mla import MultiHeadLatentAttention
from .spec import VARIANTS, AttentionSpec

__all__ = ["AttentionSpec", "GroupedQueryAttention", "MultiHeadLatentAttention", "VARIANTS", "eager_attention"]
