"""Requests' grammars in the engine: compile per request, then one bitmask per step for every constrained request
that draws a token, filled through one BatchMatcher (grammar/matcher.py: the same masks, bitmask op and dead-end
policy as generate() and speculative decoding). The runner applies the masks; a request whose exact JSON Schema
check left no continuation is rewound by the output processor through grammar/retry.py's RowRetry, generate()'s
policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..grammar import processor_from_generate_kwargs
from ..grammar.matcher import BatchMatcher


@dataclass(frozen=True)
class GrammarMasks:
    """A step's grammar masks: bitmask row i (int32 [G, ceil(V / 32)]) masks request req_ids[i]'s next token."""

    req_ids: tuple[str, ...]
    bitmask: torch.Tensor

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """In place: logits [N, V] row rows[i] masked by bitmask row i (disallowed tokens at -inf)."""
        index = torch.tensor(rows, dtype=torch.long)
        logits[index] = BatchMatcher.apply(logits[index], self.bitmask)


def request_grammar(tokenizer, eos_ids, response_format, grammar):
    """Compile (errors now, naming the field) -> a GrammarState, or None for an unconstrained request."""
    processor = processor_from_generate_kwargs(
        response_format=response_format, grammar=grammar, tokenizer=tokenizer, eos_token_id=sorted(eos_ids) or None
    )
    if processor is None:
        return None
    return processor.grammars[0].new_state()


def grammar_masks(req_ids: list[str], states: list, width: int) -> GrammarMasks:
    """The next-token masks of grammar states `states` (one per request id) over logits `width` tokens wide. A state
    with no token left below `width` becomes a dead end (only EOS allowed; check_failed() tells a failed check)."""
    matcher = BatchMatcher(states)
    return GrammarMasks(tuple(req_ids), matcher.fill_bitmask(matcher.allocate_bitmask(), width=width))


def check_failed(state) -> bool:
    """Whether a grammar state's exact check left it no valid continuation (the request may be rewound)."""
    return state.dead_at is not None and state.dead_reason.startswith("check_failed")
