"""Grammar processors inside speculative decoding: one GrammarState per row, driven by the loop.

A grammar processor re-synchronises from a rectangular input_ids whose first columns are the prompt; speculative
rows grow by different amounts, so the loop drives the processor's grammars itself:
- before verification, each row's state walks its draft (validate, then accept and roll back): the mask of every
  draft position is the grammar's mask after the draft tokens before it;
- drafts are cut at the first token the grammar rejects when the draft is a point mass or decoding is greedy (the
  target gives such a token probability 0, so it would be rejected anyway: the cut is exact and saves work);
- after verification the row's emitted tokens are accepted;
- a retry after a failed JSON Schema check (grammar/retry.py) starts from a prompt that ends with grammar output:
  the processor says how many columns (``resume``); the states accept them and mask the forbidden continuations;
- at the end, every row's final state goes back to the processor (``finish``), so generate()'s retry of rows whose
  check failed (grammar/retry.py) works as after plain decoding;
- a model drafter's logits are masked too, by walking the states along its drafts as it makes them (then rolling
  back), so its drafts stay valid (any proposal q keeps rejection sampling exact; a masked one is accepted more).
Masks, the bitmask op and the dead-end policy are grammar/matcher.py's BatchMatcher, shared with the logits
processors and the engine. The masks are applied where the processor sits in generate()'s processor list, so
temperature / top-k / top-p see exactly what they see in plain decoding.
"""

from __future__ import annotations

import torch

from ..grammar import GrammarConstrainedLogitsProcessor
from ..grammar.matcher import BatchMatcher
from .drafters import Draft


def grammar_processors(processors) -> list:
    return [p for p in processors if isinstance(p, GrammarConstrainedLogitsProcessor)]


class GrammarRows:
    """The grammar rows of one processor inside the speculative loop (masks and dead ends: grammar/matcher.py)."""

    def __init__(self, processor, input_ids: torch.Tensor):
        batch = input_ids.shape[0]
        per = batch // len(processor.grammars)
        self.matcher = BatchMatcher([processor.grammars[r // per].new_state() for r in range(batch)])
        resumed, forbid, reason = getattr(processor, "_resume", (0, {}, None))
        self.prompt_len = input_ids.shape[1] - resumed
        for b, state in enumerate(self.matcher.states):
            if forbid and hasattr(state._m, "restart"):
                state._m.restart({k: set(v) for k, v in forbid.items()}, reason)
            if resumed:
                self.matcher.accept_tokens(b, input_ids[b, self.prompt_len :].tolist())
        self._prompt = input_ids[:, : self.prompt_len].clone()
        self.rows = list(range(batch))  # the original row of each current row
        self.done: dict[int, object] = {}  # original row -> final state of the rows that left the batch
        self.masks: list[torch.Tensor] = []  # per draft position: int32 bitmask [B, W]
        self._tokens, self._valid = [], [0] * batch

    def prepare(self, draft: Draft, cut: bool) -> Draft:
        """This round's drafts; with `cut`, drafts end at their first rejected token. The masks of positions 0..k
        are built at the first apply() (which knows the logits' width: no token below it is a dead end)."""
        m = self.matcher
        self._tokens = draft.tokens.tolist()
        self._valid = [
            m.validate_tokens(b, row[:n]) for b, (row, n) in enumerate(zip(self._tokens, draft.lengths.tolist()))
        ]
        self.masks = []
        if not cut:
            return draft
        lengths = torch.minimum(draft.lengths, torch.tensor(self._valid, device=draft.lengths.device))
        return Draft(draft.tokens, lengths, draft.probs)

    def _build_masks(self, width: int) -> None:
        """Walk every row along its valid drafts: the mask of position j is the one after its first j drafts."""
        m, k = self.matcher, len(self._tokens[0]) if self._tokens else 0
        walked = [0] * len(m)
        for j in range(k + 1):
            self.masks.append(m.fill_bitmask(m.allocate_bitmask(), width=width))
            if j < k:
                for b, (row, ok) in enumerate(zip(self._tokens, self._valid)):
                    if j < ok and walked[b] == j and not m.is_dead(b):  # a dead end (failed check) ends the walk
                        walked[b] += m.accept_tokens(b, [row[j]])
        for b, n in enumerate(walked):
            m.rollback(b, n)

    def begin_draft(self, width: int) -> None:
        self._base, self._walked = width, [0] * len(self.matcher)

    def draft_mask(self, tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """A drafter's scores [B, V] for its next draft token, given tokens [B, width + j] (its j drafts so far);
        a row whose draft left the grammar may only propose EOS (the verifier rejects it there anyway)."""
        m = self.matcher
        bitmask = m.allocate_bitmask()
        for b, drafted in enumerate(tokens[:, self._base :].tolist()):
            new = drafted[self._walked[b] :]
            ok = m.validate_tokens(b, new) if new else 0
            self._walked[b] += m.accept_tokens(b, new[:ok]) if ok else 0
            if ok == len(new):
                m.fill_bitmask(bitmask, [b], width=scores.shape[-1], out_rows=[b])
            else:
                m.only_eos(bitmask, b, b)
        return m.apply(scores, bitmask)

    def end_draft(self) -> None:
        for b, walked in enumerate(self._walked):
            self.matcher.rollback(b, walked)

    def apply(self, scores: torch.Tensor, position: int) -> torch.Tensor:
        if not self.masks:
            self._build_masks(scores.shape[-1])
        return self.matcher.apply(scores, self.masks[position])

    def commit(self, new_tokens: list[list[int]]) -> None:
        for b, tokens in enumerate(new_tokens):
            self.matcher.accept_tokens(b, tokens)

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.tolist()
        kept = set(rows)
        self.done.update({self.rows[b]: s for b, s in enumerate(self.matcher.states) if b not in kept})
        self.rows = [self.rows[b] for b in rows]
        self.matcher.select(rows)

    def finish(self, processor) -> None:
        """Hand every row's final state to `processor`, as if it had run the rows itself (its finish_reasons,
        states and prompt length then read as after plain decoding)."""
        self.done.update(zip(self.rows, self.matcher.states))
        processor.reset()
        processor.prompt_len, processor._prompt = self.prompt_len, self._prompt
        processor.matcher = BatchMatcher([self.done[b] for b in range(len(self.done))])
        processor._bitmask = processor.matcher.allocate_bitmask()
