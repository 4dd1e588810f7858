"""Token bitmasks: int32 words, bit ``i % 32`` of word ``i // 32`` set = token ``i`` allowed (both backends' layout)."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import ops, reference


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
    return reference.unpack_bitmask(_cover(bitmask, width), width)


def _cover(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bitmask with zero words appended up to ceil(width / 32) (columns past the tokenizer's vocabulary: masked)."""
    missing = (width + 31) // 32 - bitmask.shape[-1]
    if missing <= 0:
        return bitmask
    return torch.cat([bitmask, bitmask.new_zeros((bitmask.shape[0], missing))], dim=1)


def apply_bitmask_(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """scores [batch, V] (any device, float): disallowed entries set to -inf in place. bitmask: int32 [batch, W].

    The one bitmask op of the package: kernels.ops.apply_token_bitmask (Triton on CUDA, torch on the CPU).
    V may differ from the tokenizer's vocabulary: columns the bitmask does not cover are masked.
    """
    mask = _cover(bitmask, scores.shape[-1]).to(scores.device, non_blocking=True)
    return ops.apply_token_bitmask(scores, mask)
