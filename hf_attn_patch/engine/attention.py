"""The registered attention function of the engine's packed forward ("hf_attn_engine").

query [1, H, T, d] holds the new tokens of many requests side by side. Per the step's plan (kv.StepPlan):
- decodes (one query token each) are batched: their contexts are gathered as [Bd, Lmax] slots with a length mask;
- prefill chunks (n query tokens at the end of a context of ctx tokens) each attend causally: query i, at position
  ctx - n + i, sees context positions <= ctx - n + i.
Pure torch (gather + SDPA, GQA through enable_gqa); the CPU path, and the reference a GPU varlen kernel replaces.
No mask function is registered under this name, so transformers builds no mask: the plan is the mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ENGINE_ATTENTION = "hf_attn_engine"


def engine_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """-> (output [1, T, H, d_v], None)."""
    plan, storage, dk = key.engine_plan, key.engine_storage, key.engine_key_dim
    if getattr(module, "sliding_window", None) or kwargs.get("sliding_window"):
        raise ValueError("the engine does not serve sliding-window attention layers")
    heads, tokens = query.shape[1], query.shape[2]
    out = query.new_empty((tokens, heads, storage.shape[-1] - dk))
    if plan.decode_tokens.numel():
        q = query[0][:, plan.decode_tokens].transpose(0, 1)[:, :, None]  # [Bd, H, 1, d]
        both = storage[plan.decode_slots].transpose(1, 2)  # [Bd, H_kv, Lmax, d_k + d_v]
        visible = torch.arange(plan.decode_slots.shape[1], device=q.device)[None, :] < plan.decode_lengths[:, None]
        o = _sdpa(q, both[..., :dk], both[..., dk:], visible[:, None, None, :], scaling)
        out[plan.decode_tokens] = o[:, :, 0].to(out.dtype)
    for start, count, slots in plan.chunks:
        q = query[:, :, start : start + count]  # [1, H, n, d]
        both = storage[slots].transpose(0, 1)[None]  # [1, H_kv, ctx, d_k + d_v]
        ctx = slots.numel()
        visible = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - count, ctx, device=q.device)[:, None]
        o = _sdpa(q, both[..., :dk], both[..., dk:], visible[None, None], scaling)
        out[start : start + count] = o[0].transpose(0, 1).to(out.dtype)
    return out[None], None


def _sdpa(q, k, v, mask, scaling):
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling,
                                          enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
