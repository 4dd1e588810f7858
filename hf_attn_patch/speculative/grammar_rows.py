"""Grammar processors inside speculative decoding: one GrammarState per row, driven by the loop.

A grammar processor re-synchronises from a rectangular input_ids whose first columns are the prompt; speculative
rows grow by different amounts, so the loop drives the processor's grammars itself:
- before verification, each row's state walks its draft (validate, then accept and roll back): the mask of every
  draft position is the grammar's mask after the draft tokens before it;
- drafts are cut at the first token the grammar rejects when the draft is a point mass or decoding is greedy (the
  target gives such a token probability 0, so it would be rejected anyway: the cut is exact and saves work);
- after verification the row's emitted tokens are accepted;
- a model drafter's logits are masked too, by walking the states along its drafts as it makes them (then rolling
  back), so its drafts stay valid (any proposal q keeps rejection sampling exact; a masked one is accepted more).
The masks are applied where the processor sits in generate()'s processor list, so temperature / top-k / top-p see
exactly what they see in plain decoding.
"""

from __future__ import annotations

import torch

from .drafters import Draft


def next_allowed(state, eos_ids: list[int]) -> torch.Tensor:
    """Bool [V]: the grammar's next tokens; a dead end allows only EOS (the row ends, never an invalid token)."""
    allowed = state.allowed_mask()
    return allowed if allowed.any() else only_eos(allowed.numel(), eos_ids)


def only_eos(vocab_size: int, eos_ids: list[int]) -> torch.Tensor:
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    allowed[eos_ids] = True
    return allowed


def mask_scores(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """scores [B, V'] with tokens not in allowed [B or 1, V] (and logit columns past V) at -inf, in place."""
    allowed = allowed.to(scores.device)
    width = min(scores.shape[-1], allowed.shape[-1])
    scores[:, :width] = scores[:, :width].masked_fill(~allowed[:, :width], float("-inf"))
    scores[:, width:] = float("-inf")
    return scores


def grammar_processors(processors) -> list:
    from ..grammar import GrammarConstrainedLogitsProcessor

    return [p for p in processors if isinstance(p, GrammarConstrainedLogitsProcessor)]


class GrammarRows:
    def __init__(self, processor, batch: int):
        per = batch // len(processor.grammars)
        self.processor = processor
        self.states = [processor.grammars[r // per].new_state() for r in range(batch)]
        self.eos = list(processor.eos_token_ids)
        self.vocab_size = processor.vocab_size
        self.masks: list[torch.Tensor] = []  # per draft position: bool [B, V] allowed

    def prepare(self, draft: Draft, cut: bool) -> Draft:
        """Masks for positions 0..k of this round; with `cut`, drafts end at their first rejected token."""
        k = draft.tokens.shape[1]
        tokens = draft.tokens.tolist()
        valid = [state.validate_tokens(row[: int(n)]) for state, row, n in zip(self.states, tokens, draft.lengths)]
        self.masks = []
        for j in range(k + 1):
            self.masks.append(torch.stack([next_allowed(state, self.eos) for state in self.states]))
            if j < k:
                for state, row, ok in zip(self.states, tokens, valid):
                    if j < ok:
                        state.accept_tokens([row[j]])
        for state, ok in zip(self.states, valid):
            state.rollback(min(ok, k))
        if not cut:
            return draft
        lengths = torch.minimum(draft.lengths, torch.tensor(valid, device=draft.lengths.device))
        return Draft(draft.tokens, lengths, draft.probs)

    def begin_draft(self, width: int) -> None:
        self._base, self._walked = width, [0] * len(self.states)

    def draft_mask(self, tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """A drafter's scores [B, V] for its next draft token, given tokens [B, width + j] (its j drafts so far)."""
        rows = tokens[:, self._base :].tolist()
        masks = []
        for b, (state, drafted) in enumerate(zip(self.states, rows)):
            new = drafted[self._walked[b] :]
            taken = state.accept_tokens(new) if new else 0
            self._walked[b] += taken
            masks.append(next_allowed(state, self.eos) if taken == len(new) else only_eos(self.vocab_size, self.eos))
        return mask_scores(scores, torch.stack(masks))

    def end_draft(self) -> None:
        for state, walked in zip(self.states, self._walked):
            state.rollback(walked)

    def apply(self, scores: torch.Tensor, position: int) -> torch.Tensor:
        return mask_scores(scores, self.masks[position])

    def commit(self, new_tokens: list[list[int]]) -> None:
        for state, tokens in zip(self.states, new_tokens):
            state.accept_tokens(tokens)

    def select(self, rows: torch.Tensor) -> None:
        self.states = [self.states[i] for i in rows.tolist()]
