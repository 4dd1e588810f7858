"""The additive score bias of attention written by hand (MLA's absorbed form, latent K/V): whatever mask the model
built for its attention implementation, or plain causal (and sliding-window) masking when it built none."""

from __future__ import annotations

import torch


def mask_bias(bias, mask, sliding_window, shape, like) -> torch.Tensor | None:
    """Add whatever mask the model built for its attention implementation to the additive score bias.

    bias: [B, H*T, S] or None; shape: (B, H, T, S). mask: 4D bool (sdpa: True = attend) or float (eager: additive);
    2D [B, S] padding mask (flash: 1 = token); None means plain causal, queries aligned to the last T keys (sdpa and
    flash drop all-ones masks). Returns [B, H*T, S], or None when nothing is added and nothing is masked (a decode
    step of one query with no padding sees every key). `like` gives the bias's dtype and device.
    """
    batch, heads, length, seq = shape
    if mask is not None and mask.dim() == 4:
        mask = mask[..., :seq]
        if mask.dtype != torch.bool:  # additive, [B or 1, 1, T, S]
            mask = mask.to(like.dtype)
            return (mask if bias is None else bias.view(shape) + mask).expand(shape).reshape(batch, -1, seq)
        allowed = mask
    elif mask is None and length == 1 and (sliding_window is None or seq <= sliding_window):
        return bias
    else:
        query_pos = torch.arange(seq - length, seq, device=like.device)[:, None]
        key_pos = torch.arange(seq, device=like.device)[None, :]
        allowed = key_pos <= query_pos
        if sliding_window is not None:
            allowed = allowed & (key_pos > query_pos - sliding_window)
        allowed = allowed[None, None]
        if mask is not None:  # 2D padding mask
            allowed = allowed & mask[:, None, None, -seq:].bool()
    if bias is None:
        bias = like.new_zeros(batch, heads * length, seq)
    return bias.view(shape).masked_fill(~allowed, torch.finfo(bias.dtype).min).view(batch, -1, seq)
