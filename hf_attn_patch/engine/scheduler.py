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

The scheduler owns the requests' places: the KV manager (a step's blocks), the queues, how much of each request is
computed and its n-gram drafts (speculative/drafters.py's lookup over its tokens, proposed as a step is planned
and verified in the same forward). It returns the step as a SchedulerOutput, a value naming requests by id (the
runner reads only that); the output processor, applying the step's result, calls `update()` (the scheduled tokens
are computed, full blocks named), `drop_drafts()`, `rewind()` and `finish()`.
"""

from __future__ import annotations

from collections import deque

import torch

from ..cache.block_pool import NULL_BLOCK
from ..cache.manager import KVManager
from ..speculative.drafters import ngram_lookup
from .request import Request
from .scheduler_output import PromptLogprobRows, SamplingView, SchedulerOutput


class Scheduler:
    def __init__(
        self, kv: KVManager, max_batch_tokens: int, max_num_seqs: int, chunked_prefill: bool, prefill_chunk: int | None
    ):
        """kv: the KV manager, from now on this scheduler's (block tables, prefix hits, preemption)."""
        self.kv, self.max_batch_tokens, self.max_num_seqs = kv, max_batch_tokens, max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.prefill_chunk = prefill_chunk or max_batch_tokens
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self._prefill_scheduled = False
        self.running: list[Request] = []
        self.preemptions = 0
        self._preempted: list[str] = []  # ids preempted in the step being scheduled

    def add(self, request: Request) -> None:
        self.requests[request.id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """This step's plan: the requests, how many tokens each computes, and where (module docstring)."""
        self._propose_drafts()
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

    def _propose_drafts(self) -> None:
        """n-gram lookup drafts for decoding requests that asked for speculation (verified in the same forward)."""
        for request in self.running:
            k = min(request.params.num_speculative_tokens, request.params.max_tokens - len(request.generated) - 1)
            if k > 0 and request.grammar is None and request.computed == len(request.tokens) - 1:
                request.draft = ngram_lookup(torch.tensor(request.tokens), k).tolist()

    def _output(self, plan: list[tuple[Request, int]]) -> SchedulerOutput:
        kv, groups = self.kv, self.kv.groups
        rows, sampling, prompt_logprobs, start = [], {}, {}, 0
        for request, n in plan:  # the logits rows the step needs, in packing order
            k = request.params.prompt_logprobs
            stop = min(request.computed + n, len(request.prompt_ids) - 1)
            if k is not None and stop > request.computed:  # positions p predicting prompt token p + 1
                targets = tuple(request.prompt_ids[request.computed + 1 : stop + 1])
                prompt_logprobs[request.id] = PromptLogprobRows(len(rows), request.computed + 1, targets, k)
                rows.extend(range(start, start + len(targets)))
            if request.remaining == n:  # it reaches its end: its last token and every draft position
                view = SamplingView(request.params, request.generator, tuple(request.draft), len(rows))
                sampling[request.id] = view
                rows.extend(range(start + n - 1 - len(request.draft), start + n))
            start += n
        return SchedulerOutput(
            req_ids=tuple(r.id for r, _ in plan),
            num_tokens=tuple(n for _, n in plan),
            token_ids=tuple(tuple((r.tokens + r.draft)[r.computed : r.computed + n]) for r, n in plan),
            starts=tuple(r.computed for r, _ in plan),
            block_tables=tuple({g: list(kv.table(r.id, g)) for g in groups} for r, _ in plan),
            state_slots=tuple(kv.state_slot(r.id) if kv.states is not None else None for r, _ in plan),
            copies=tuple(kv.take_copies()),
            preempted=tuple(self._preempted),
            pool_blocks={g: kv.pools[g].num_blocks for g in groups},
            logits_rows=tuple(rows),
            sampling=sampling,
            prompt_logprobs=prompt_logprobs,
        )

    def update(self, plan: SchedulerOutput) -> None:
        """After the forward: each request's scheduled tokens are computed; blocks that filled are named for prefix
        hits (drafts are not: they may be rejected)."""
        size = self.kv.block_size
        for request_id, n in zip(plan.req_ids, plan.num_tokens):
            request = self.requests[request_id]
            request.computed += n
            if request.draft or request.computed // size > (request.computed - n) // size:  # a block filled
                self.kv.commit(request.id, request.tokens[: request.computed])

    def drop_drafts(self, request: Request, accepted: int) -> None:
        """After sampling: the rejected drafts' positions are no longer computed (their K/V is overwritten later)."""
        request.computed -= len(request.draft) - accepted
        request.draft = []

    def finish(self, request: Request) -> None:
        """The request leaves: out of its queue and the registry, its blocks released."""
        self.requests.pop(request.id, None)
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
                position = next(
                    (i for i, r in enumerate(self.waiting) if r.arrival > request.arrival), len(self.waiting)
                )
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
            if any(b == NULL_BLOCK for b in table[first : num_tokens // size + 1]):
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
