"""Token bitmasks: int32 words, bit ``i % 32`` of word ``i // 32`` set = token ``i`` allowed (both backends' layout)."""

from __future__ import annotations

import numpy as np
import torch

_SHIFTS: dict = {}


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 tensor [batch, ceil(vocab_size / 32)], all bits set."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def words_u32(bitmask: torch.Tensor) -> np.ndarray:
    """The bitmask's memory as a uint32 numpy array (shares storage; CPU only)."""
    return bitmask.numpy().view(np.uint32)


def set_tokens(bitmask: torch.Tensor, index: int, token_ids, allowed: bool) -> None:
    """Set (allowed=True) or clear the bits of `token_ids` in row `index`."""
    w = words_u32(bitmask)[index]
    for t in token_ids:
        if t // 32 < w.shape[0]:
            bit = np.uint32(1 << (t % 32))
            w[t // 32] = (w[t // 32] | bit) if allowed else (w[t // 32] & ~bit)


def only_tokens(bitmask: torch.Tensor, index: int, token_ids) -> None:
    """Row `index` allows exactly `token_ids`."""
    bitmask[index].zero_()
    set_tokens(bitmask, index, token_ids, True)


def any_allowed(bitmask: torch.Tensor, index: int, limit: int) -> bool:
    """Whether row `index` allows any token id < `limit`."""
    w = words_u32(bitmask)[index]
    full = min(limit // 32, w.shape[0])
    if w[:full].any():
        return True
    rest = limit - 32 * full
    if rest > 0 and full < w.shape[0]:
        return bool(int(w[full]) & ((1 << rest) - 1))
    return False


def unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [batch, width] (True = allowed) from an int32 bitmask [batch, words], on the bitmask's device.

    Columns past 32 * words are False (tokens the tokenizer does not know are never allowed).
    """
    key = bitmask.device
    shifts = _SHIFTS.get(key)
    if shifts is None:
        shifts = _SHIFTS[key] = torch.arange(32, dtype=torch.int32, device=key)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= width:
        return bits[:, :width]
    pad = torch.zeros(bitmask.shape[0], width - bits.shape[1], dtype=torch.bool, device=key)
    return torch.cat([bits, pad], dim=1)


def apply_bitmask_(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """scores [batch, V] (any device, float): disallowed entries set to -inf in place. bitmask: CPU int32 [batch, W].

    V may differ from the tokenizer's vocabulary: columns the bitmask does not cover are masked.
    """
    mask = bitmask.to(scores.device, non_blocking=True)
    allowed = unpack(mask, scores.shape[-1])
    scores.masked_fill_(~allowed, float("-inf"))
    return scores
