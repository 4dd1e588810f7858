"""Requests' grammars in the engine: compile per request, then mask a step's sampling rows through one BatchMatcher
(grammar/matcher.py: the same masks, bitmask op and dead-end policy as generate() and speculative decoding). A request
whose exact JSON Schema check failed is rewound by core.py through grammar/retry.py's RowRetry, generate()'s policy."""

from __future__ import annotations

import torch

from ..grammar import processor_from_generate_kwargs
from ..grammar.matcher import BatchMatcher


def request_grammar(tokenizer, eos_ids, response_format, grammar):
    """Compile (errors now, naming the field) -> a GrammarState, or None for an unconstrained request."""
    processor = processor_from_generate_kwargs(response_format=response_format, grammar=grammar, tokenizer=tokenizer,
                                               eos_token_id=sorted(eos_ids) or None)  # fmt: skip
    if processor is None:
        return None
    return processor.grammars[0].new_state()


def mask_rows(logits: torch.Tensor, rows: list[int], states: list) -> BatchMatcher:
    """In place: logits [N, V] rows `rows` masked by grammar states `states` (one each). -> the step's matcher
    (its row i is states[i]), for accepting the sampled tokens."""
    matcher = BatchMatcher(states)
    bitmask = matcher.fill_bitmask(matcher.allocate_bitmask(), width=logits.shape[-1])
    index = torch.tensor(rows, dtype=torch.long)
    logits[index] = matcher.apply(logits[index], bitmask)
    return matcher
