"""BatchMatcher: B rows of grammar states behind one interface, with one bitmask op and one dead-end policy.

Used by the logits processors (generate()), speculative decoding (speculative/grammar_rows.py) and the engine
(engine/grammar_link.py), so all three constrain the same way:

    matcher = BatchMatcher(states)                     # one GrammarState per row
    matcher.accept_tokens(row, tokens) -> int          # advance row by the longest accepted prefix
    matcher.fill_bitmask(bitmask, rows=None, width=V)  # next-token masks into int32 [B, ceil(V_tok / 32)]
    matcher.apply(scores, bitmask)                     # the one op: kernels.ops.apply_token_bitmask, in place
    matcher.rollback(row, n); matcher.is_terminated(row); matcher.finish_reason(row)

Policy, the same for every caller:
- EOS is allowed only where the row's grammar accepts; a terminated row (EOS accepted, or nothing but EOS can
  follow) allows only EOS.
- A dead end (a token the grammar rejects was given to accept_tokens, or no token is allowed within the logits'
  `width`) allows only EOS from then on, so the row ends and an invalid token is never produced; the reason is kept
  on the state (``dead_reason``, "token 7 at position 3 rejected by the grammar") until a rollback goes below it.
  The forced EOS that follows a dead end is not consumed (accept_tokens returns 0); other tokens are judged afresh.
"""

from __future__ import annotations

import logging

import torch

from . import bitmask as bm
from .state import GrammarState

logger = logging.getLogger(__name__)


class BatchMatcher:
    def __init__(self, states: list[GrammarState]):
        self.states = list(states)

    def __len__(self) -> int:
        return len(self.states)

    # ------------------------------------------------------------------ advancing
    def accept_tokens(self, row: int, tokens) -> int:
        """Advance `row` by the longest accepted prefix of `tokens`; a rejected token makes the row a dead end."""
        state = self.states[row]
        tokens = list(tokens)
        if not tokens:
            return 0
        if state.dead_at is not None:
            if tokens[0] in state.eos_token_ids:
                return 0  # the EOS forced after the dead end
            self.clear_dead(row)  # another continuation than the rejected one: judge it afresh
        n = state.accept_tokens(tokens)
        if n < len(tokens) and not state.is_terminated():
            error = state.error() or ""  # a failed check left no continuation here: that is the reason
            if not error.startswith("check_failed") and tokens[n] in state.eos_token_ids:
                state.fill_bitmask(bm.allocate_bitmask(1, state.vocab_size), 0)  # an EOS forced after a failure
                error = state.error() or ""  # found before a rollback below it (rejected drafts): found again
            self._dead(
                row,
                error
                if error.startswith("check_failed")
                else f"token {tokens[n]} at position {len(state.tokens)} rejected by the grammar",
            )
        return n

    def validate_tokens(self, row: int, tokens) -> int:
        """How many leading `tokens` row `row` accepts from here (state unchanged; 0 for a dead row)."""
        state = self.states[row]
        return 0 if state.dead_at is not None else state.validate_tokens(tokens)

    def clear_dead(self, row: int) -> None:
        """Forget row's dead end (the caller no longer continues with the token that caused it)."""
        self.states[row].dead_at = self.states[row].dead_reason = None

    def rollback(self, row: int, num_tokens: int) -> None:
        self.states[row].rollback(num_tokens)

    def select(self, rows) -> None:
        """Keep rows `rows` (indices, in that order)."""
        self.states = [self.states[int(i)] for i in rows]

    # ------------------------------------------------------------------ queries
    def is_terminated(self, row: int) -> bool:
        return self.states[row].is_terminated()

    def is_dead(self, row: int) -> bool:
        return self.states[row].dead_at is not None

    def finish_reason(self, row: int) -> str | None:
        """None (running), "eos" (grammar complete and EOS taken), "check_failed: <keyword> at <schema path>" (an
        exact JSON Schema check kept failing until its budget ran out) or "dead_end: <reason>"."""
        state = self.states[row]
        if state.dead_at is not None:
            if state.dead_reason.startswith("check_failed"):
                return state.dead_reason
            return "dead_end: " + state.dead_reason
        ended = state.is_terminated() and bool(state.tokens) and state.tokens[-1] in state.eos_token_ids
        return "eos" if ended else None

    def forced_tokens(self, row: int) -> list[int]:
        return [] if self.is_dead(row) else self.states[row].forced_tokens()

    # ------------------------------------------------------------------ masks
    def allocate_bitmask(self, rows: int | None = None) -> torch.Tensor:
        return bm.allocate_bitmask(len(self) if rows is None else rows, self.states[0].vocab_size)

    def fill_bitmask(self, bitmask: torch.Tensor, rows=None, width: int | None = None, out_rows=None) -> torch.Tensor:
        """Masks of `rows` (default all) into bitmask rows `out_rows` (default 0..): allowed tokens, EOS where the
        grammar accepts, only EOS for terminated and dead rows. `width`: the logits' width (tokens >= width cannot
        be sampled, so a row allowing none below it is a dead end). Returns bitmask."""
        rows = range(len(self)) if rows is None else rows
        out_rows = range(len(rows)) if out_rows is None else out_rows
        for row, out in zip(rows, out_rows):
            state = self.states[row]
            if state.dead_at is not None:
                bm.only_tokens(bitmask, out, state.eos_token_ids)
                continue
            state.fill_bitmask(bitmask, out)
            limit = state.vocab_size if width is None else min(width, state.vocab_size)
            if not state.is_terminated() and not bm.any_allowed(bitmask, out, limit):
                error = state.error() or ""
                self._dead(
                    row,
                    error
                    if error.startswith("check_failed")
                    else f"grammar backend error: {error}"
                    if error
                    else "no token allowed by the grammar within the model's vocabulary",
                )
                bm.only_tokens(bitmask, out, state.eos_token_ids)
        return bitmask

    def only_eos(self, bitmask: torch.Tensor, out: int, row: int = 0) -> None:
        """Bitmask row `out` allows only the EOS tokens of row `row` (without marking the row dead)."""
        bm.only_tokens(bitmask, out, self.states[row].eos_token_ids)

    @staticmethod
    def apply(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """scores [N, V'] (any device): tokens the bitmask [N, W] disallows, and columns past it, at -inf, in place."""
        return bm.apply_bitmask_(scores, bitmask)

    def _dead(self, row: int, reason: str) -> None:
        state = self.states[row]
        state.dead_at, state.dead_reason = len(state.tokens), reason
        logger.warning("grammar row %d: %s; forcing EOS", row, reason)
