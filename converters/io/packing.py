"""Mixed-length calibration (calib_lengths): samples of several lengths packed into every calibration window, so a
conversion calibrated for long contexts still gives short positions their weight.

A window of T = sum(lengths) tokens holds one sample per length, in order; its position_ids restart at 0 with each
sample (`packed_positions`), from which transformers builds the block-diagonal causal mask of packed sequences: each
sample attends to itself only, so its activations are those of the sample alone. With calib_source "teacher" each
sample is the source's own continuation of its first tokens (`packed_teacher_windows`: the samples of one length are
drawn together). 2 windows of 2048,1024,512,256,256 hold the default's 8,192 tokens with 10 samples starting at
position 0 (the 32 x 256 default: 32; 8 x 1,024: 8).
"""

from __future__ import annotations

import torch


def parse_lengths(lengths: str, length: int) -> tuple[int, ...]:
    """The sample lengths of calib_lengths ("2048,1024,512,256,256"), checked to be positive and to sum to calib_len."""
    try:
        parts = tuple(int(part) for part in str(lengths).split(","))
    except ValueError:
        parts = ()
    if not parts or min(parts) < 2 or sum(parts) != length:
        raise ValueError(
            f"calib_lengths={lengths!r} must be comma-separated sample lengths >= 2 summing to calib_len={length}"
        )
    return parts


def packed_positions(lengths: tuple[int, ...]) -> torch.Tensor:
    """position_ids [sum(lengths)] of a packed window: 0..l-1 for each sample in turn."""
    return torch.cat([torch.arange(length) for length in lengths])


def packed_teacher_windows(
    sample, teacher, text_windows: torch.Tensor, lengths: tuple[int, ...], seed: int = 0
) -> torch.Tensor:
    """Packed windows [n, sum(lengths)] of teacher samples: every sample slot of text_windows [n, sum(lengths)]
    continued from its own first tokens by sample(teacher, windows [k, l], seed=seed) (calibration.teacher_windows),
    the slots of one length sampled together."""
    slots = list(text_windows.split(list(lengths), dim=1))  # per slot: [n, length]
    n = len(text_windows)
    for length in sorted(set(lengths)):
        where = [k for k, l in enumerate(lengths) if l == length]
        drawn = sample(teacher, torch.cat([slots[k] for k in where]), seed=seed)
        for j, k in enumerate(where):
            slots[k] = drawn[j * n : (j + 1) * n]
    return torch.cat(slots, dim=1)
