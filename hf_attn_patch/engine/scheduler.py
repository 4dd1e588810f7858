"""Iteration-level scheduling under a token budget, with chunked prefill, prefix caching and preemption.

Policy (FIFO by arrival, documented in the README):
1. Running requests first, oldest first: a decoding request gets its 1 token; a request still in prefill gets the
   next chunk of its prompt (at most `prefill_chunk` tokens and what is left of the step's `max_batch_tokens`).
2. Then waiting requests join, oldest first, while budget, blocks and `max_num_seqs` allow. A waiting request
   that does not fit blocks the ones behind it (no overtaking), so nothing starves.
3. When a running request needs a block and none is free, the newest running request is preempted: its blocks are
   released and it goes back to the front of the waiting queue with its generated tokens (recompute; its full
   blocks are usually still in the prefix cache). A request is never lost or corrupted: its tokens are the truth.
Without chunked prefill, a prompt is prefilled whole in one step; the step's first prefill may exceed the budget
(decodes then wait for it: the stall chunked prefill removes).

The scheduler owns the KV manager: it allocates a step's blocks, returns the step as a SchedulerOutput (the runner
reads only that), and after the forward `update()` advances the requests and names their full blocks.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache.block_pool import NULL_BLOCK
from ..cache.manager import KVManager
from .params import SamplingParams
from .scheduler_output import SchedulerOutput


@dataclass(eq=False)  # identity: `in` / remove() on the queues must not compare every field
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens whose K/V is in the cache (its blocks: the KV manager's, under its id)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    first_token_time: float | None = None
    generator: torch.Generator | None = None
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


class Scheduler:
    def __init__(self, kv: KVManager, max_batch_tokens: int, max_num_seqs: int, chunked_prefill: bool,
                 prefill_chunk: int | None):  # fmt: skip
        """kv: the KV manager, from now on this scheduler's (block tables, prefix hits, preemption)."""
        self.kv, self.max_batch_tokens, self.max_num_seqs = kv, max_batch_tokens, max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.prefill_chunk = prefill_chunk or max_batch_tokens
        self.waiting: deque[Request] = deque()
        self._prefill_scheduled = False
        self.running: list[Request] = []
        self.preemptions = 0
        self._preempted: list[str] = []  # ids preempted in the step being scheduled

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """This step's plan: the requests, how many tokens each computes, and where (module docstring)."""
        budget, plan = self.max_batch_tokens, []
        self._prefill_scheduled = False
        self._preempted = []
        for request in sorted(self.running, key=lambda r: r.arrival):
            if request not in self.running:  # preempted by an older request earlier in this loop
                continue
            n = self._take(request, budget)
            if n and self._reserve(request, n, keep=[r for r, _ in plan]):
                plan.append((request, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits = self._attach_prefix(request) if request.id not in self.kv.sequences else 0
            n = self._take(request, budget)
            if not n or not self._fits(request, n):
                self._release(request)
                break
            self.waiting.popleft()
            request.prefix_hit_tokens = max(request.prefix_hit_tokens, hits)
            self._grow(request, n)
            self.running.append(request)
            plan.append((request, n))
            budget -= n
        return self._output(plan)

    def _output(self, plan: list[tuple[Request, int]]) -> SchedulerOutput:
        kv, groups = self.kv, self.kv.groups
        return SchedulerOutput(
            requests=[r for r, _ in plan], num_tokens=[n for _, n in plan],
            token_ids=[(r.tokens + r.draft)[r.computed : r.computed + n] for r, n in plan],
            starts=[r.computed for r, _ in plan],
            block_tables=[{g: list(kv.table(r.id, g)) for g in groups} for r, _ in plan],
            state_slots=[kv.state_slot(r.id) if kv.states is not None else None for r, _ in plan],
            copies=kv.take_copies(), preempted=self._preempted,
            pool_blocks={g: kv.pools[g].num_blocks for g in groups},
        )  # fmt: skip

    def update(self, output: SchedulerOutput) -> None:
        """After the forward: each request's scheduled tokens are computed; blocks that filled are named for prefix
        hits (drafts are not: they may be rejected)."""
        size = self.kv.block_size
        for request, n in output:
            request.computed += n
            if request.draft or request.computed // size > (request.computed - n) // size:  # a block filled
                self.kv.commit(request.id, request.tokens[: request.computed])

    def drop_drafts(self, request: Request, accepted: int) -> None:
        """After sampling: the rejected drafts' positions are no longer computed (their K/V is overwritten later)."""
        request.computed -= len(request.draft) - accepted
        request.draft = []

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def rewind(self, request: Request, num_tokens: int) -> None:
        """Forget the K/V of positions >= num_tokens (a grammar retry took tokens back). Blocks wholly past them are
        released; a kept block named in the prefix cache stays named and is copied before the next write into it
        (KVManager.crop), so other sequences sharing it never see the new tokens. Constant-state layers cannot cut
        their state back, and a sliding window may have freed keys the position needs again: such a request is
        released and recomputes from its start, as after a preemption."""
        if request.computed <= num_tokens:
            return
        if self.kv.states is not None or self._window_freed(request, num_tokens):
            if request in self.running:
                self.running.remove(request)
                self._release(request)
                position = next((i for i, r in enumerate(self.waiting) if r.arrival > request.arrival),
                                len(self.waiting))
                self.waiting.insert(position, request)
            return
        self.kv.crop(request.id, num_tokens)
        request.computed = num_tokens

    # -- helpers ---------------------------------------------------------------------------------------------

    def _window_freed(self, request: Request, num_tokens: int) -> bool:
        """Whether a window group freed a block that position `num_tokens` attends to (keys > num_tokens - w)."""
        size = self.kv.block_size
        for g in self.kv.groups:
            if g is None:
                continue
            table = self.kv.table(request.id, g)
            first = max(0, num_tokens - g + 1) // size
            if any(b == NULL_BLOCK for b in table[first: num_tokens // size + 1]):
                return True
        return False

    def _take(self, request: Request, budget: int) -> int:
        need = request.remaining
        if request.computed >= len(request.tokens) - 1:  # decoding: its last token plus any drafts, never split
            del request.draft[max(0, budget - 1) :]  # verify fewer drafts rather than wait
            return request.remaining if request.remaining <= budget else 0
        if self.chunked_prefill:
            n = min(need, budget, self.prefill_chunk)
        else:  # the whole prompt; the step's first prefill may exceed the budget (it stalls that step's decodes)
            n = need if need <= budget or not self._prefill_scheduled else 0
        self._prefill_scheduled = self._prefill_scheduled or n > 0
        return n

    def _fits(self, request: Request, n: int) -> bool:
        return self.kv.can_allocate(request.id, request.computed, request.computed + n)

    def _grow(self, request: Request, n: int) -> None:
        self.kv.free_out_of_window(request.id, request.computed)  # before allocating: the freed blocks are reusable
        self.kv.allocate(request.id, request.computed, request.computed + n)

    def _reserve(self, request: Request, n: int, keep: list[Request]) -> bool:
        """Blocks for n more tokens of a running request, preempting the newest others if needed."""
        while not self._fits(request, n):
            victims = [r for r in self.running if r is not request and r not in keep]
            if not victims:
                self._preempt(request)
                return False
            self._preempt(max(victims, key=lambda r: r.arrival))
        self._grow(request, n)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.preemptions += 1
        self.preemptions += 1
        self._preempted.append(request.id)
        position = next((i for i, r in enumerate(self.waiting) if r.arrival > request.arrival), len(self.waiting))
        self.waiting.insert(position, request)

    def _release(self, request: Request) -> None:
        self.kv.free(request.id)
        request.computed, request.draft = 0, []

    def _attach_prefix(self, request: Request) -> int:
        """Start the request in the KV manager, sharing the cached blocks of its leading full blocks (not the one
        holding its last token); returns the positions skipped. A request asking for prompt logprobs takes no hit
        (every prompt position must be computed)."""
        self.kv.add(request.id)
        wants_all = request.params.prompt_logprobs is not None
        hits = [] if wants_all else self.kv.cached_prefix_blocks(request.tokens)
        request.computed = self.kv.attach_prefix(request.id, hits)
        return request.computed
