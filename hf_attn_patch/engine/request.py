"""A request inside the engine: its tokens, where its KV stands, its grammar state and its counters.

Each field has one writer. The scheduler places the request (`computed`, `draft`, `preemptions`,
`prefix_hit_tokens`); the output processor applies what a step produced (`generated`, the grammar state's advance,
`finish_reason`, `first_token_time`, `proposed` / `accepted`). Neither hands a Request to the runner: a step's plan
names requests by id and copies out what the runner reads (scheduler_output.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .params import SamplingParams


@dataclass(eq=False)  # identity: `in` / remove() on the scheduler's queues must not compare every field
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens whose K/V is in the cache (its blocks: the KV manager's, under its id)
    finish_reason: str | None = None
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    first_token_time: float | None = None
    generator: torch.Generator | None = None  # a seeded request's own stream (advanced by the runner's draws)
    grammar: object = None  # a grammar state (hf_attn_patch.grammar) when the request is constrained
    draft: list[int] = field(default_factory=list)  # speculative tokens verified in this step (after `tokens`)
    proposed: int = 0  # speculative tokens proposed / accepted so far
    accepted: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def remaining(self) -> int:
        """Tokens to run through the model before the next sample (1 + drafts when decoding)."""
        return len(self.prompt_ids) + len(self.generated) + len(self.draft) - self.computed
