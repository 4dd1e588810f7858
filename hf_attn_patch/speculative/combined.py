"""n-gram lookup where a row repeats its history, the feature drafter everywhere else (per row, per round).

`generate(..., assistant_model=feature_drafter, prompt_lookup_num_tokens=k)`. Each round row b takes the n-gram
proposal when lookup finds at least `trust` tokens (its prompt or output repeats there: rewriting, quoting, code),
else the feature drafter's. The feature drafter runs only in rounds where some row needs it; in the others its
cache simply falls behind and catches up on its next run (feature_drafter.FeatureDrafter keeps the pending
features). When sampling, an n-gram row's q is a point mass on its draft (one-hot), as with lookup alone.
"""

from __future__ import annotations

import torch

from .drafters import Draft, Drafter, PromptLookupDrafter
from .feature_drafter import FeatureDrafter
from .sequences import Sequences


class LookupOrFeatureDrafter(Drafter):
    def __init__(self, lookup: PromptLookupDrafter, feature: FeatureDrafter, feature_max: int, trust: int = 3):
        self.lookup, self.feature, self.feature_max, self.trust = lookup, feature, feature_max, trust

    def start(self, sequences: Sequences, attention_mask: torch.Tensor, target=None) -> None:
        self.feature.start(sequences, attention_mask, target)

    def propose(self, sequences: Sequences, k: int, process, do_sample: bool) -> Draft:
        found = self.lookup.propose(sequences, k, process, do_sample)
        use_lookup = found.lengths >= min(k, self.trust)
        if bool(use_lookup.all()):
            return found
        width = min(k, self.feature_max)
        drafted = self.feature.propose(sequences, width, process, do_sample)
        own = ~use_lookup
        tokens = found.tokens.clone()
        tokens[own, :width] = drafted.tokens[own]
        lengths = torch.where(use_lookup, found.lengths, torch.full_like(found.lengths, width))
        probs = None
        if do_sample:  # rows of lookup: one-hot q; positions past a row's length are never read
            probs = torch.nn.functional.one_hot(tokens, self.feature.vocab_size).to(drafted.probs.dtype)
            probs[own, :width] = drafted.probs[own]
        return Draft(tokens, lengths, probs)

    def accepted(self, counts: torch.Tensor) -> None:
        self.feature.accepted(counts)

    def select(self, rows: torch.Tensor) -> None:
        self.feature.select(rows)

    def finish(self) -> None:
        self.feature.finish()
