"""The smallest valid completion of a checked row whose attempts ran out (checked_matcher.py).

When the exact checks have masked ``max_attempts`` closing tokens of one value (attempts.py), the model keeps
choosing values that fail; rather than ending the row with an invalid prefix, the matcher finishes it with a short
valid completion found here, so that the row ends inside the grammar with a valid document. Best-first search over the
grammar's allowed tokens (exact checks included): cost = tokens so far + a small penalty for a token that does not
close anything (bytes ``"`` ``]`` ``}`` first, then digits); a node's children are built when they are taken
from the queue, at most ``MAX_EXPANSIONS`` of them; None when no completion is found within ``MAX_TOKENS`` tokens.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import torch

MAX_TOKENS = 64
MAX_EXPANSIONS = 400
_CLOSING = frozenset(b'"]}')
_DIGITS = frozenset(b"0123456789")


def _rank(data: bytes) -> float:
    if any(b in _CLOSING for b in data):
        return 0.0
    if data and all(b in _DIGITS for b in data):
        return 0.25
    return 0.5 + 0.01 * len(data)


def smallest_completion(matcher) -> list[int] | None:
    """Token ids that take `matcher` (a CheckedMatcher; unchanged) to a state where the whole text validates."""
    token_bytes = matcher.checks.token_bytes
    mask = torch.zeros((1, (len(token_bytes) + 31) // 32), dtype=torch.int32)
    start = matcher.clone()
    start.budget.counted, start.completion = False, None  # no budget in the search: no search inside it
    tie = itertools.count()
    heap = [(0.0, next(tie), [], start, None)]  # (cost, tie, path, parent, token): a child is built when popped
    for _ in range(MAX_EXPANSIONS):
        if not heap:
            return None
        cost, _, path, node, token = heapq.heappop(heap)
        if token is not None:
            node = node.clone()
            if node.consume([token]) != 1:
                continue
        if node.m.is_accepting() and node._gate_failure() is None:
            return path
        if len(path) >= MAX_TOKENS or node.failed:
            continue
        mask.zero_()
        node.fill(mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[: len(token_bytes)])
        for t in allowed.tolist():
            heapq.heappush(heap, (len(path) + 1 + _rank(token_bytes[t]), next(tie), path + [t], node, t))
    return None
