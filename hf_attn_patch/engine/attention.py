"""The registered attention function of the engine's packed forward ("hf_attn_engine"), and its MLA twin.

query [1, H, T, d] holds the new tokens of many requests side by side. Per the step's plan (kv.StepPlan) the
tokens form segments:
- decodes (one query token each) are batched in groups of similar context length: contexts gathered as
  [g, Lmax] slots with a length mask;
- each prefill chunk (n query tokens at the end of a context of ctx tokens) attends causally: query i, at
  position ctx - n + i, sees context positions <= ctx - n + i.
Pure torch (gather + SDPA, GQA through enable_gqa); the CPU path, and the reference a GPU varlen kernel replaces.
No mask function is registered under this name, so transformers builds no mask: the plan is the mask.
MLA layers store [latent | RoPE key] per token and attend over the latent (absorbed) per segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ENGINE_ATTENTION = "hf_attn_engine"


def is_engine_handle(tensor) -> bool:
    return getattr(tensor, "engine_plan", None) is not None


def segments(handle):
    """Yield (queries selector, keys [b, H_kv, L, d_k], values [b, H_kv, L, d_v], visible [b, 1, q, L] bool)."""
    plan, storage, dk = handle.engine_plan, handle.engine_storage, handle.engine_key_dim
    for tokens, slots, lengths in plan.decode_groups:
        both = storage[slots].transpose(1, 2)  # [g, H_kv, Lmax, d_k + d_v]
        visible = torch.arange(slots.shape[1], device=both.device)[None, :] < lengths[:, None]
        yield tokens, both[..., :dk], both[..., dk:], visible[:, None, None, :]
    for start, count, slots in plan.chunks:
        both = storage[slots].transpose(0, 1)[None]  # [1, H_kv, ctx, d_k + d_v]
        ctx = slots.numel()
        positions = torch.arange(ctx, device=both.device)
        visible = positions[None, :] <= positions[ctx - count :, None]
        yield slice(start, start + count), both[..., :dk], both[..., dk:], visible[None, None]


def select_queries(x: torch.Tensor, selector) -> torch.Tensor:
    """x [1, H, T, d] -> [b, H, q, d]: decodes as a batch of single queries, a chunk as one row of n."""
    if isinstance(selector, slice):
        return x[:, :, selector]
    return x[0][:, selector].transpose(0, 1)[:, :, None]


def place_outputs(out: torch.Tensor, selector, o: torch.Tensor) -> None:
    """Write o [b, q, H, d_v] (attention output, token-major) into out [T, H, d_v]."""
    out[selector] = (o[0] if isinstance(selector, slice) else o[:, 0]).to(out.dtype)


def engine_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """-> (output [1, T, H, d_v], None)."""
    if getattr(module, "sliding_window", None) or kwargs.get("sliding_window"):
        raise ValueError("the engine does not serve sliding-window attention layers")
    out = query.new_empty((query.shape[2], query.shape[1], value.shape[-1]))
    for selector, k, v, visible in segments(key):
        q = select_queries(query, selector)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=visible, scale=scaling,
                                           enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
        place_outputs(out, selector, o.transpose(1, 2))
    return out[None], None


def engine_mla_forward(module, q_nope, q_rope, latent_handle) -> torch.Tensor:
    """MLA over the engine's latent pages: q [1, H, T, *] -> [1, T, H, d_v], absorbed attention per segment."""
    out = q_nope.new_empty((q_nope.shape[2], q_nope.shape[1], module.v_head_dim))
    for selector, latent, k_rope, visible in segments(latent_handle):
        o, _ = module._absorbed(select_queries(q_nope, selector), select_queries(q_rope, selector), latent, k_rope,
                                visible)  # fmt: skip
        place_outputs(out, selector, o)
    return out[None]
