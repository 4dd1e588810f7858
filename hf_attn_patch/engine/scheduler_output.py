"""A step's plan as a value: what the scheduler decided and everything the runner needs to compute it.

The runner reads only this (never a Request's mutable fields): per scheduled request its tokens, the position of the
first one, its block tables and constant-state slot; for the step the copy-on-write block copies to apply before the
forward and each pool's size. The engine keeps `requests` (the handles it samples and reports with).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerOutput:
    requests: list = field(default_factory=list)  # the scheduled Requests, in packing order
    num_tokens: list[int] = field(default_factory=list)  # tokens each one computes this step
    token_ids: list[list[int]] = field(default_factory=list)  # those tokens (prompt, generated, then drafts)
    starts: list[int] = field(default_factory=list)  # position of each one's first scheduled token
    block_tables: list[dict] = field(default_factory=list)  # per request {group: block table} (copies)
    state_slots: list[int | None] = field(default_factory=list)  # per request its constant-state slot (hybrid)
    copies: list[tuple] = field(default_factory=list)  # copy-on-write (group, source block, target block)
    preempted: list[str] = field(default_factory=list)  # ids of the requests preempted this step
    pool_blocks: dict = field(default_factory=dict)  # group -> blocks in its pool (the storage's first dimension)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __iter__(self):
        """(request, number of tokens) pairs, in packing order."""
        return iter(zip(self.requests, self.num_tokens))
