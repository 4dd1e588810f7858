"""Names for full KV blocks: a hash chain over their tokens, so equal prefixes name equal blocks.

h_0 = H(b"" || tokens[0:bs]),  h_i = H(h_{i-1} || tokens[i*bs:(i+1)*bs])
A block's name covers every token before it, so a hit on block i implies hits on blocks 0..i-1 (and their keys,
RoPE'd at the same positions, are the same tensors).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def block_hashes(tokens: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Hashes of the full blocks of `tokens` (a trailing partial block gets none)."""
    data = np.asarray(tokens, dtype=np.int64)
    out = []
    for start in range(0, len(data) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + data[start : start + block_size].tobytes(), digest_size=16).digest()
        out.append(parent)
    return out
