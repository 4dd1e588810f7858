"""A request's grammar in the engine: the grammar package's GrammarState behind three calls the engine makes."""

from __future__ import annotations

import torch

from ..speculative.grammar_rows import mask_scores, next_allowed


class RequestGrammar:
    def __init__(self, state, eos_ids: list[int]):
        self.state, self.eos_ids = state, eos_ids

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] -> disallowed tokens at -inf; a dead end allows only EOS (never an invalid token)."""
        return mask_scores(logits.clone(), next_allowed(self.state, self.eos_ids)[None])

    def accept(self, token: int) -> None:
        self.state.accept_tokens([token])

    def is_terminated(self) -> bool:
        return self.state.is_terminated()


def request_grammar(tokenizer, eos_ids, response_format, grammar) -> RequestGrammar | None:
    """Compile (errors now, naming the field) -> RequestGrammar, or None for an unconstrained request."""
    from ..grammar import processor_from_generate_kwargs

    processor = processor_from_generate_kwargs(response_format=response_format, grammar=grammar, tokenizer=tokenizer,
                                               eos_token_id=sorted(eos_ids) or None)  # fmt: skip
    if processor is None:
        return None
    return RequestGrammar(processor.grammars[0].new_state(), list(processor.eos_token_ids))
