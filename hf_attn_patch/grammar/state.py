"""GrammarState: the grammar position of one sequence, independent of generate().

Used per row by the logits processors, and directly by speculative decoding / a serving engine:

    state = compile_grammar(GrammarSpec.json_schema(schema), tok).new_state()
    n_ok = state.validate_tokens(draft)           # how many leading draft tokens the grammar accepts
    state.accept_tokens(verified)                 # advance
    state.rollback(k)                             # undo the last k accepted tokens
    state.fill_bitmask(bitmask, row)              # next-token mask into an int32 [*, ceil(V/32)] CPU tensor

EOS is handled here, not by the backend: an EOS id is accepted only where the grammar accepts, and then the state is
terminated (only EOS allowed after it). Invariant: ``self.tokens`` is exactly what the matcher has consumed, plus a
final EOS when terminated.
"""

from __future__ import annotations

import torch

from . import bitmask as bm


class GrammarState:
    """Grammar state of one sequence. Build from ``CompiledGrammar.new_state()``.

    tokens: the token ids accepted so far (list, read-only by convention).
    vocab_size: width of the masks (the tokenizer's vocabulary; bitmask words = ceil(vocab_size / 32)).
    """

    def __init__(self, matcher, eos_token_ids, vocab_size: int, backend: str = "", banned_token_ids=()):
        self._m = matcher
        self.banned_token_ids = tuple(banned_token_ids)
        self.eos_token_ids = tuple(eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)
        self.vocab_size = vocab_size
        self.backend = backend
        self.tokens: list[int] = []
        self._terminated = False
        # dead end (set by grammar.matcher.BatchMatcher): at len(tokens) == dead_at only EOS may follow;
        # a rollback below that point clears it
        self.dead_at: int | None = None
        self.dead_reason: str | None = None

    # ------------------------------------------------------------------ advancing
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar rejects it."""
        return self.accept_tokens([token_id]) == 1

    def accept_tokens(self, token_ids) -> int:
        """Advance by the longest accepted prefix of `token_ids`; returns its length (the rest is not consumed)."""
        ids = [int(t) for t in token_ids]
        if self._terminated or not ids:
            return 0
        k = next((i for i, t in enumerate(ids) if t in self._eos), len(ids))
        n = self._m.consume(ids[:k])
        self.tokens.extend(ids[:n])
        if n == k < len(ids) and self._m.is_accepting():
            self.tokens.append(ids[k])
            self._terminated = True
            n += 1
        return n

    def validate_tokens(self, token_ids) -> int:
        """Number of leading tokens of `token_ids` the grammar accepts from here; the state is unchanged."""
        ids = [int(t) for t in token_ids]
        if self._terminated or not ids:
            return 0
        k = next((i for i, t in enumerate(ids) if t in self._eos), len(ids))
        if k == len(ids):
            return self._m.validate(ids)
        n = self._m.consume(ids[:k])
        ok = n == k and self._m.is_accepting()
        self._m.rollback(n)
        return n + 1 if ok else n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (0 <= num_tokens <= len(self.tokens))."""
        if not 0 <= num_tokens <= len(self.tokens):
            raise ValueError(f"num_tokens: expected 0..{len(self.tokens)}, got {num_tokens}")
        if num_tokens == 0:
            return
        if self._terminated:
            self._terminated = False
            self.tokens.pop()
            num_tokens -= 1
        self._m.rollback(num_tokens)
        del self.tokens[len(self.tokens) - num_tokens :]
        if self.dead_at is not None and len(self.tokens) < self.dead_at:
            self.dead_at = self.dead_reason = None

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self.rollback(len(self.tokens))

    # ------------------------------------------------------------------ queries
    @property
    def retryable(self) -> bool:
        """Whether a failed exact JSON Schema check can be retried from an earlier point (grammar/retry.py)."""
        return self._m.retryable

    def is_terminated(self) -> bool:
        """True after an EOS was accepted, or when the grammar can only end (nothing but EOS can follow)."""
        return self._terminated or self._m.is_stopped()

    def is_accepting(self) -> bool:
        """True if the tokens so far form a complete output (EOS may follow)."""
        return self._terminated or self._m.is_accepting()

    def error(self) -> str | None:
        """The backend's error message if the matcher is in an error state."""
        return self._m.error()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (fast-forward / jump-forward), possibly empty; the state is unchanged."""
        if self.is_terminated():
            return []
        return [t for t in self._m.forced_tokens() if t not in self._eos]

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
        """Write the next-token mask into row `index` of `bitmask` (CPU int32 [*, ceil(vocab_size / 32)]).

        EOS bits are set iff the grammar accepts here; other special tokens are never set; a terminated state allows
        only EOS.
        Returns False if no token at all is allowed (a dead end; the row is left all-zero).
        """
        if (
            bitmask.dtype != torch.int32
            or bitmask.device.type != "cpu"
            or bitmask.shape[-1] != (self.vocab_size + 31) // 32
        ):
            raise ValueError(
                f"bitmask: expected a CPU int32 tensor [*, {(self.vocab_size + 31) // 32}], "
                f"got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
            )
        if self._terminated:
            bm.only_tokens(bitmask, index, self.eos_token_ids)
            return True
        self._m.fill(bitmask, index)
        bm.set_tokens(bitmask, index, self.banned_token_ids, False)
        bm.set_tokens(bitmask, index, self.eos_token_ids, self._m.is_accepting())
        return bm.any_allowed(bitmask, index, self.vocab_size)

    def allowed_mask(self) -> torch.Tensor:
        """Bool [vocab_size]: True where the next token is allowed."""
        mask = bm.allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask(mask, 0)
        return bm.unpack(mask, self.vocab_size)[0]

    def clone(self) -> "GrammarState":
        """An independent copy (same grammar, same position)."""
        other = GrammarState(
            self._m.clone(),
            self.eos_token_ids,
            self.vocab_size,
            backend=self.backend,
            banned_token_ids=self.banned_token_ids,
        )
        other.tokens = list(self.tokens)
        other._terminated = self._terminated
        other.dead_at, other.dead_reason = self.dead_at, self.dead_reason
        return other

    def __repr__(self) -> str:
        return (
            f"GrammarState(backend={self.backend!r}, tokens={len(self.tokens)}, "
            f"accepting={self.is_accepting()}, terminated={self.is_terminated()})"
        )
