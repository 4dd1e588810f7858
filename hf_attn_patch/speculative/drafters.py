"""Drafters: propose up to k next tokens per row for the target model to verify.

The interface is four methods, so a new drafter (say a converted MQA/MLA or layer-pruned copy of the target) plugs
in by subclassing `Drafter`:
- `start(sequences, attention_mask, target)`: once, after the target's prefill (`target`: its ragged.RaggedModel);
- `propose(sequences, k, process, do_sample) -> Draft`: tokens [B, k], per-row lengths [B] (<= k) and, for
  drafters that sample, their processed probabilities q [B, k, V] (None = point mass on each token);
- `accepted(counts)`: row b's first counts[b] drafts were accepted (the sequences are extended after this call);
- `select(rows)`: only these rows remain in the batch;
- `finish()`: once, when decoding ends (also on error): release what `__init__` or `start` hooked into the target.
`process(tokens [B, W], logits [B, V]) -> scores [B, V]` applies generate()'s logits processors (temperature,
top-k, top-p, ...), so q is processed exactly as the target's p is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .ragged import RaggedModel, early_exit_view
from .sequences import Sequences


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, k] long
    lengths: torch.Tensor  # [B] long, row b proposes tokens[b, :lengths[b]]
    probs: torch.Tensor | None = None  # [B, k, V] drafter probabilities after processing, None for a point mass


class Drafter:
    """Base class (see the module docstring for the protocol)."""

    def start(self, sequences: Sequences, attention_mask: torch.Tensor, target: RaggedModel | None = None) -> None:
        pass

    def propose(self, sequences: Sequences, k: int, process, do_sample: bool) -> Draft:
        raise NotImplementedError

    def accepted(self, counts: torch.Tensor) -> None:
        pass

    def select(self, rows: torch.Tensor) -> None:
        pass

    def finish(self) -> None:
        pass


class PromptLookupDrafter(Drafter):
    """n-gram lookup (prompt lookup decoding): find the row's last n tokens earlier in the row (prompt or output,
    the most recent occurrence, longest n first) and propose what followed them. Free to run; a point mass."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes: need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, sequences: Sequences, k: int, process, do_sample: bool) -> Draft:
        batch = sequences.tokens.shape[0]
        tokens = sequences.tokens.new_zeros((batch, k))
        lengths = torch.zeros(batch, dtype=torch.long)
        for b in range(batch):
            continuation = ngram_lookup(sequences.row(b), k, self.max_ngram, self.min_ngram)
            tokens[b, : len(continuation)] = continuation
            lengths[b] = len(continuation)
        return Draft(tokens, lengths.to(tokens.device))


def ngram_lookup(row: torch.Tensor, k: int, max_ngram: int = 3, min_ngram: int = 1) -> torch.Tensor:
    """Up to k tokens that followed an earlier occurrence of row's last n tokens (longest n first): the most
    recent occurrence with k tokens after it, else the one with the most tokens after it (the earliest)."""
    for n in range(min(max_ngram, len(row) - 1), min_ngram - 1, -1):
        windows = row[:-1].unfold(0, n, 1)  # every earlier n-gram that has at least one token after it
        hits = (windows == row[-n:]).all(1).nonzero().flatten()
        if hits.numel():
            full = hits[hits + n + k <= len(row)]
            start = int(full[-1] if full.numel() else hits[0]) + n
            return row[start : start + k]
    return row[:0]


def draft_chain(sequences: Sequences, k: int, process, do_sample: bool, logits: torch.Tensor, step):
    """k draft tokens, one after another: the first from logits [B, V], each next from step(token [B]) -> [B, V].
    Returns tokens [B, k] and, when sampling, their processed probabilities [B, k, V] (else None)."""
    drafts, probs = [], []
    for j in range(k):
        step_tokens = sequences.with_drafts(torch.stack(drafts, 1) if drafts else sequences.tokens[:, :0])
        scores = process(step_tokens, logits)
        if do_sample:
            q = scores.softmax(-1)
            token = torch.multinomial(q, 1).squeeze(1)
            probs.append(q)
        else:
            token = scores.argmax(-1)
        drafts.append(token)
        if j < k - 1:
            logits = step(token)
    return torch.stack(drafts, 1), torch.stack(probs, 1) if do_sample else None


class ModelDrafter(Drafter):
    """A smaller model sharing the tokenizer (`assistant_model=`), or the target's first `num_layers` layers with its
    final norm and LM head (`assistant_early_exit=`, layer-skip self-drafting, run through ragged.early_exit_view).

    A separate model keeps its own cache, whose rows are rolled back per row like the target's (ragged.RaggedModel).
    Early exit over a DynamicCache target keeps none: the target's first `num_layers` layers hold exactly the
    drafter's keys and values for every verified token, so each round starts from an alias of them (shared tensors:
    caches grow by concatenation and shrink by slicing, never in place) and feeds only the target's newest token.
    No prefill, no catch-up after rounds without drafts, nothing to roll back."""

    def __init__(self, model, vocab_size: int, num_layers: int | None = None):
        self.early_exit = num_layers is not None
        self.model = early_exit_view(model, num_layers) if self.early_exit else model
        self.vocab_size = vocab_size

    def start(self, sequences: Sequences, attention_mask: torch.Tensor, target: RaggedModel | None = None) -> None:
        self._proposed = 0
        self.target = target if self.early_exit and target is not None and type(target.cache) is DynamicCache else None
        if self.target is not None:
            return
        mask = attention_mask.long()
        cache = DynamicCache(config=self.model.config)
        self.state = RaggedModel(self.model, cache, mask[:, :0], torch.zeros_like(mask[:, 0]))
        width = sequences.tokens.shape[1]
        if width > 1:  # the prompt minus its last token, which is fed with the first draft step
            self.state.forward(sequences.tokens[:, : width - 1], mask[:, : width - 1].bool())
        self.synced = sequences.lengths - 1

    def _alias_target(self, sequences: Sequences) -> None:
        """Start this round from the target's first layers (it holds every token but the newest of each row)."""
        cache = DynamicCache(config=self.model.config)
        for mine, theirs in zip(cache.layers, self.target.cache.layers):
            vars(mine).update(vars(theirs))  # keys, values (and a sliding layer's counters) by reference
        self.state = RaggedModel(self.model, cache, self.target.mask, self.target.next_position)
        self.synced = sequences.lengths - 1

    def propose(self, sequences: Sequences, k: int, process, do_sample: bool) -> Draft:
        if self.target is not None:
            self._alias_target(sequences)
        pending = sequences.lengths - self.synced  # >= 1 tokens per row not yet in the drafter's cache
        n = int(pending.max())
        feed = sequences.tokens[:, -n:]
        valid = torch.arange(n, device=feed.device)[None, :] >= (n - pending)[:, None]
        self.state.mark()
        logits = self.state.forward(feed, valid, last_only=True)[:, -1]
        step = lambda token: self._fit_vocab(self.state.forward(token[:, None], last_only=True)[:, -1])  # noqa: E731
        tokens, probs = draft_chain(sequences, k, process, do_sample, self._fit_vocab(logits), step)
        self._base_lengths, self._pending, self._proposed = sequences.lengths.clone(), pending, k
        return Draft(tokens, torch.full_like(pending, k), probs)

    def accepted(self, counts: torch.Tensor) -> None:
        if self.target is not None:  # the next round aliases the target again
            self.state, self._proposed = None, 0
            return
        if not self._proposed:
            return
        in_cache = counts.clamp(max=self._proposed - 1)  # the last draft token was never fed to the drafter
        self.state.keep(self._pending + in_cache)
        self.synced = self._base_lengths + in_cache
        self._proposed = 0

    def select(self, rows: torch.Tensor) -> None:
        if self.target is None:  # an alias of the target follows the target's own select
            self.state.select(rows)
            self.synced = self.synced[rows]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's logits over the target's vocabulary (embedding matrices are often padded differently)."""
        if logits.shape[-1] == self.vocab_size:
            return logits
        if logits.shape[-1] > self.vocab_size:
            return logits[:, : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
