"""Continuous batching: every step packs prefill chunks and decodes of many requests into one model forward.

    engine = Engine(model, tokenizer, max_batch_tokens=512, block_size=16, max_memory=2**30)
    outputs = engine.generate(["Once upon a time", "The cat"], SamplingParams(max_tokens=64, temperature=0))
    rid = engine.add_request("Hello", SamplingParams(max_tokens=8)); for out in engine.stream(): ...

A step: the scheduler picks (request, n tokens) pairs; their tokens go through the model as one row [1, T] with
their own position ids; the registered attention function "hf_attn_engine" reads each request's context from the
paged storage (kv.py, attention.py); requests whose computed tokens reach their end sample their next token;
finished requests free their blocks at once (full blocks stay cached for prefix hits until evicted).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from ..kv_memory import kv_cache_bytes
from ..speculative.drafters import ngram_lookup
from ..speculative.rejection import verify_greedy, verify_sampling
from .params import RequestOutput, SamplingParams
from .runner import ModelRunner
from .scheduler import Request, Scheduler

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, tokenizer, *, max_batch_tokens: int = 512, block_size: int = 16,
                 max_memory: int | None = None, num_blocks: int | None = None, max_num_seqs: int = 64,
                 chunked_prefill: bool = True, prefill_chunk: int | None = None, prefix_caching: bool = True):  # fmt: skip
        config = model.config.get_text_config(decoder=True)
        for name, value in (("max_batch_tokens", max_batch_tokens), ("block_size", block_size),
                            ("max_num_seqs", max_num_seqs)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine: {name}={value!r} must be a positive integer")
        dtype = next(model.parameters()).dtype
        if num_blocks is None:
            memory = max_memory if max_memory is not None else 512 * 1024 * 1024
            num_blocks = memory // kv_cache_bytes(config, block_size, dtype=dtype)  # one block, all layers
        if num_blocks < 2:
            raise ValueError(f"Engine: max_memory={max_memory} holds {num_blocks} blocks; need at least 2")
        self.model, self.tokenizer = model, tokenizer
        self.runner = ModelRunner(model, num_blocks, block_size, prefix_caching)
        self.kv = self.runner.kv  # the KV manager: block tables, prefix hits, preemption
        self.scheduler = Scheduler(self.kv, max_batch_tokens, max_num_seqs, chunked_prefill, prefill_chunk)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.vocab_size = config.vocab_size
        self.requests: dict[str, Request] = {}
        self.lock = threading.RLock()  # add_request / abort may come from other threads (the server)
        self._ids = itertools.count()
        self._aborted: list[RequestOutput] = []
        self.steps = 0

    # -- requests ----------------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:  # fmt: skip
        """Queue a request (validated now, before any work); returns its id."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt).input_ids
        else:
            prompt_ids = list(prompt)
        if not prompt_ids or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt: expected a non-empty text or token ids in [0, {self.vocab_size}), got {prompt!r:.80}")
        blocks = -(-(len(prompt_ids) + params.max_tokens) // self.kv.block_size)
        if blocks > self.kv.num_blocks - 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens={params.max_tokens} needs {blocks} "
                             f"blocks; the engine has {self.kv.num_blocks - 1} (raise max_memory)")  # fmt: skip
        grammar = self._grammar_state(params)
        with self.lock:
            request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
            if request_id in self.requests:
                raise ValueError(f"request_id={request_id!r} is already in use")
            request = Request(request_id, prompt_ids, params, grammar=grammar)
            if params.seed is not None:
                request.generator = torch.Generator().manual_seed(params.seed)
            self.requests[request_id] = request
            self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        with self.lock:
            request = self.requests.pop(request_id, None)
            if request is None:
                return
            self.scheduler.finish(request)
            request.finish_reason = "abort"
            self._aborted.append(self._output(request, "", finished=True))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- running -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step and one packed forward; outputs of requests that gained tokens or finished."""
        with self.lock:
            outputs, self._aborted = self._aborted, []
            self._propose_drafts()
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return outputs
            samplers = [(r, n) for r, n in scheduled if r.remaining == n]  # they reach their end: sample
            logits = self.runner.forward(scheduled)
            for request, n in scheduled:
                request.computed += n
                self.kv.commit(request.id, request.tokens[: request.computed])  # drafts are not named
            for request, _ in samplers:
                rows, logits = logits[: 1 + len(request.draft)], logits[1 + len(request.draft) :]
                outputs.append(self._advance(request, rows))
            self.steps += 1
        return outputs

    def _propose_drafts(self) -> None:
        """n-gram lookup drafts for decoding requests that asked for speculation (verified in the same forward)."""
        for request in self.scheduler.running:
            k = min(request.params.num_speculative_tokens, request.params.max_tokens - len(request.generated) - 1)
            if k > 0 and request.grammar is None and request.computed == len(request.tokens) - 1:
                request.draft = ngram_lookup(torch.tensor(request.tokens), k).tolist()

    def stream(self):
        """Yield outputs step by step until every request has finished."""
        while self.has_unfinished() or self._aborted:
            yield from self.step()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None):
        """Offline: run prompts to completion -> list[RequestOutput] in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final = {}
        for out in self.stream():
            if out.finished:
                final[out.request_id] = out
        return [final[i] for i in ids]

    # -- internals ---------------------------------------------------------------------------------------------

    def _advance(self, request: Request, logits: torch.Tensor) -> RequestOutput:
        """logits [1 + drafts, V] -> sample (verify drafts), append tokens up to the first stop, report."""
        request.first_token_time = request.first_token_time or time.perf_counter()
        params, draft = request.params, request.draft
        logits = logits[:, : self.vocab_size]
        if request.grammar is not None:
            logits = request.grammar.mask_logits(logits)
        scores = torch.stack([_process(row, params) for row in logits])  # [1 + d, V]
        drafts = torch.tensor([draft], dtype=torch.long)
        if params.greedy:
            accepted, token = verify_greedy(scores[None], drafts, torch.tensor([len(draft)]))
        else:
            accepted, token = verify_sampling(scores[None].softmax(-1), drafts, torch.tensor([len(draft)]), None,
                                              request.generator)  # fmt: skip
        accepted = int(accepted)
        request.computed -= len(draft) - accepted  # the rejected drafts' K/V is overwritten later
        request.proposed, request.accepted = request.proposed + len(draft), request.accepted + accepted
        request.draft = []
        before, reason = request.text, None
        for position, token in enumerate(draft[:accepted] + [int(token)]):
            reason = self._append(request, token, scores[position], len(before))
            if reason is not None:
                break
        new_text = request.text[len(before) :] if request.text.startswith(before) else request.text
        if reason is not None:
            request.finish_reason = reason
            self.scheduler.finish(request)
            self.requests.pop(request.id, None)
        return self._output(request, new_text, finished=reason is not None)

    def _append(self, request: Request, token: int, scores: torch.Tensor, searched: int) -> str | None:
        """Add one token; returns the finish reason it causes, if any."""
        params = request.params
        request.generated.append(token)
        if params.logprobs:
            request.logprobs.append(float(scores.log_softmax(-1)[token]))
        if request.grammar is not None:
            request.grammar.accept(token)
        request.text = self.tokenizer.decode(request.generated, skip_special_tokens=True)
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if params.stop and (cut := _find_stop(request.text, params.stop, searched)) is not None:
            request.text = request.text[:cut]
            return "stop"
        if len(request.generated) >= params.max_tokens:
            return "length"
        if request.grammar is not None and request.grammar.is_terminated():
            return "stop"
        return None

    def _output(self, request: Request, new_text: str, finished: bool) -> RequestOutput:
        return RequestOutput(
            request.id, request.prompt_ids, list(request.generated), request.text, finished, request.finish_reason,
            list(request.logprobs) if request.params.logprobs else None, new_text, request.prefix_hit_tokens,
            {"arrival": request.arrival, "first_token": request.first_token_time, "preemptions": request.preemptions,
             "speculative_proposed": request.proposed, "speculative_accepted": request.accepted,
             "finished": time.perf_counter() if finished else None},
        )  # fmt: skip

    def _grammar_state(self, params: SamplingParams):
        if params.response_format is None and params.grammar is None:
            return None
        from .grammar_link import request_grammar

        return request_grammar(self.tokenizer, self.eos_ids, params.response_format, params.grammar)


def _process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p on one row of logits [V] (greedy needs none)."""
    if params.greedy:
        return logits
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return scores


def _find_stop(text: str, stops: list[str], searched: int) -> int | None:
    """Index of the earliest stop string that ends in the new part of text, or None."""
    start = max(0, searched - max(len(s) for s in stops))
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None
