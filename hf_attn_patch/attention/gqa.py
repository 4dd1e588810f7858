"""Grouped-query attention: H query heads share H_kv key/value heads (MHA: H_kv = H, MQA: H_kv = 1).

The KV cache stores only the H_kv heads: [B, H_kv, S, d_h] keys and values per layer. Heads are repeated (or, with
SDPA, grouped) only inside the attention function, never in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kv_memory import head_dim
from .base import VariantAttention
from .rope import apply_rope
from .spec import AttentionSpec, positive
from ..variants import CacheSpec, Variant, register


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 like transformers' Llama/Qwen/DeepSeek norms."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """softmax(q k^T * scaling + mask) v with K/V heads repeated to the query heads; fp32 softmax.

    query [B, H, T, d_qk], key [B, H_kv, S, d_qk], value [B, H_kv, S, d_v], mask additive [B, 1, T, >=S] or None.
    Returns ([B, T, H, d_v], weights [B, H, T, S]). The fallback when config._attn_implementation is "eager".
    """
    n_rep = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(n_rep, dim=1)
    value = value.repeat_interleave(n_rep, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[..., : key.shape[-2]]
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def attention_function(config):
    """The attention kernel transformers would use for this config (sdpa, eager, flash, or a registered one)."""
    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention)


class GroupedQueryAttention(VariantAttention):
    """Drop-in attention layer for every supported architecture.

    x [B, T, D] -> q = x W_q^T [B, H, T, d_h], k = x W_k^T, v = x W_v^T [B, H_kv, T, d_h]
    (optional per-head RMSNorm on q, k; RoPE on the first rotary_dim dims) -> cache -> attention -> o_proj.
    Parameter names are Llama's (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm).
    """

    variant = "gqa"

    def __init__(self, config, layer_idx: int, spec: GQASpec):
        super().__init__(config, layer_idx, spec)
        h, h_kv, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.head_dim = d
        self.num_key_value_groups = h // h_kv  # read by transformers' sdpa/flash functions for GQA
        self.scaling = spec.scaling if spec.scaling is not None else d**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.q_bias)
        self.k_proj = nn.Linear(spec.hidden_size, h_kv * d, bias=spec.k_bias)
        self.v_proj = nn.Linear(spec.hidden_size, h_kv * d, bias=spec.v_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None

    def layer_forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
        batch, length, _ = hidden_states.shape
        shape = (batch, length, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.spec.rotary_dim:
            cos, sin = position_embeddings
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, weights = attention_function(self.config)(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.spec.dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.spec.sliding_window,
            **kwargs,
        )
        return self.o_proj(out.reshape(batch, length, -1)), weights


@dataclass(frozen=True, kw_only=True)
class GQASpec(AttentionSpec):
    """q [H, d_h], k/v [H_kv, d_h]: MHA is H_kv = H, MQA is H_kv = 1."""

    num_key_value_heads: int | None

    def check(self) -> None:
        h, h_kv = self.num_attention_heads, self.num_key_value_heads
        positive("num_key_value_heads", h_kv)
        if h % h_kv:
            raise ValueError(
                f"num_key_value_heads={h_kv} must divide num_attention_heads={h} (GQA groups need equal size)"
            )


def spec_fields(config, layer_idx: int, arch, common: dict) -> dict:
    """GQASpec's own fields from a config: its KV heads and the family's softmax scale."""
    return dict(
        num_key_value_heads=getattr(config, "num_key_value_heads", None),
        scaling=arch.scaling(config, layer_idx, common["head_dim"]),
    )


def cache_spec(config, layer_idx: int) -> CacheSpec:
    """Keys and values of the KV heads (MHA: every head, MQA: one; one head keeps its key and value in one row)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kind = "mha" if kv_heads == heads else "mqa" if kv_heads == 1 else "gqa"
    d = head_dim(config)
    return CacheSpec(kind, kv_heads, d, d, fused=kv_heads == 1)


VARIANT = register(Variant("gqa", GroupedQueryAttention, GQASpec, spec_fields, cache_spec))
