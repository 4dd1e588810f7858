"""The token history of a batch whose rows grow by different amounts.

Rows are kept right-aligned in `tokens` [B, W] (left-filled with the pad id), which is what a left-padded prompt
already is: appending j draft tokens to every row keeps them aligned, so logits processors and stopping criteria
get one rectangular tensor per draft position, as in plain generate().
"""

from __future__ import annotations

import torch


class Sequences:
    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int):
        self.tokens = input_ids.clone()  # [B, W], row b's tokens are tokens[b, W - lengths[b]:]
        self.pad_token_id = pad_token_id
        width = input_ids.shape[1]
        if attention_mask is None:
            self.lengths = torch.full((input_ids.shape[0],), width, dtype=torch.long, device=input_ids.device)
        else:
            self.lengths = attention_mask.long().sum(1)
        self.generated: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
        self.rows = list(range(input_ids.shape[0]))  # original batch index of each current row

    def row(self, b: int) -> torch.Tensor:
        return self.tokens[b, self.tokens.shape[1] - int(self.lengths[b]) :]

    def with_drafts(self, drafts: torch.Tensor) -> torch.Tensor:
        """tokens followed by drafts [B, j] (same j for every row, so rows stay aligned) -> [B, W + j]."""
        return torch.cat([self.tokens, drafts], dim=1) if drafts.shape[1] else self.tokens

    def extend(self, new_tokens: list[list[int]]) -> None:
        """Append new_tokens[b] to row b (lists of different lengths)."""
        device = self.tokens.device
        rows = [
            torch.cat([self.row(b), torch.tensor(added, dtype=torch.long, device=device)])
            for b, added in enumerate(new_tokens)
        ]
        width = max(len(row) for row in rows)
        self.tokens = self.tokens.new_full((len(rows), width), self.pad_token_id)
        for b, row in enumerate(rows):
            self.tokens[b, width - len(row) :] = row
            self.generated[self.rows[b]].extend(new_tokens[b])
        self.lengths = torch.tensor([len(row) for row in rows], dtype=torch.long, device=device)

    def select(self, keep: torch.Tensor) -> None:
        self.tokens, self.lengths = self.tokens[keep], self.lengths[keep]
        self.rows = [self.rows[i] for i in keep.tolist()]
        self._trim()

    def _trim(self) -> None:
        """Drop leading columns that are padding in every row."""
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if longest < self.tokens.shape[1]:
            self.tokens = self.tokens[:, self.tokens.shape[1] - longest :]

    def output(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt as given, then each row's generated tokens, right-padded with the pad id: generate()'s layout."""
        longest = max((len(g) for g in self.generated), default=0)
        out = input_ids.new_full((input_ids.shape[0], input_ids.shape[1] + longest), self.pad_token_id)
        out[:, : input_ids.shape[1]] = input_ids
        for b, generated in enumerate(self.generated):
            if generated:
                out[b, input_ids.shape[1] : input_ids.shape[1] + len(generated)] = torch.tensor(generated)
        return out
