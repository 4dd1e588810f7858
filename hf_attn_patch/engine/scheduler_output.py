"""A step's plan as a value: what the scheduler decided and everything the runner needs to compute and sample it.

Requests are named by id; nothing in the plan is a live Request. Per scheduled request, in packing order: its
tokens, the position of the first one, its block tables and constant-state slot. For the step: the copy-on-write
block copies to apply before the forward, each pool's size, and `logits_rows`, the packed positions whose logits
the step needs. Then per request id what those rows are for: `sampling` for each request that reaches its next
token (its last token's row and one per draft), `prompt_logprobs` for each one scoring prompt tokens.

    plan.token_ids[i]        tokens of request plan.req_ids[i]: prompt, generated, then drafts; T = sum of lengths
    plan.logits_rows         indices into the step's T packed tokens; the runner's logits are [len(logits_rows), V]
    plan.sampling[id].row    that request's first logits row; its 1 + len(draft) rows follow one another
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .params import SamplingParams


@dataclass(frozen=True)
class SamplingView:
    """How one request's next token is drawn this step."""

    params: SamplingParams
    generator: torch.Generator | None  # a seeded request's own stream (the draw advances it), else None
    draft: tuple[int, ...]  # speculative tokens verified after its last token
    row: int  # its first logits row (the last token's; each draft's row follows)


@dataclass(frozen=True)
class PromptLogprobRows:
    """The prompt tokens one request scores this step: rows row.. of the logits predict prompt tokens first.."""

    row: int
    first: int  # index in the prompt of the first token scored
    targets: tuple[int, ...]  # the prompt tokens scored
    k: int  # top alternatives per position


@dataclass(frozen=True)
class SchedulerOutput:
    req_ids: tuple[str, ...] = ()  # the scheduled requests, in packing order
    num_tokens: tuple[int, ...] = ()  # tokens each one computes this step
    token_ids: tuple[tuple[int, ...], ...] = ()  # those tokens (prompt, generated, then drafts)
    starts: tuple[int, ...] = ()  # position of each one's first scheduled token
    block_tables: tuple[dict, ...] = ()  # per request {group: block table} (copies)
    state_slots: tuple[int | None, ...] = ()  # per request its constant-state slot (hybrid)
    copies: tuple[tuple, ...] = ()  # copy-on-write (group, source block, target block)
    preempted: tuple[str, ...] = ()  # ids of the requests preempted this step
    pool_blocks: dict = field(default_factory=dict)  # group -> blocks in its pool (the storage's first dimension)
    logits_rows: tuple[int, ...] = ()  # packed positions whose logits the step needs
    sampling: dict[str, SamplingView] = field(default_factory=dict)  # requests reaching their next token
    prompt_logprobs: dict[str, PromptLogprobRows] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.req_ids)
