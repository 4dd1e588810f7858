"""The engine: request API + step loop over the scheduler, the model runner, the batched sampler and the detokenizer.

    engine = Engine(model, tokenizer, max_batch_tokens=512, block_size=16, max_memory=2**30)
    outputs = engine.generate(["Once upon a time", "The cat"], SamplingParams(max_tokens=64, temperature=0))
    rid = engine.add_request("Hello", SamplingParams(max_tokens=8)); for out in engine.stream(): ...

A step: n-gram drafts are proposed for requests that asked for speculation; the scheduler picks (request, n tokens)
pairs under the token budget; the runner runs them as one packed forward and returns the logits rows the step
needs (each sampling request's last token and draft positions; every prompt position of a request that asked for
prompt logprobs); the grammar rows are masked with one bitmask; all sampling requests are sampled / verified at once
(sampler.py); each request's new tokens go through its incremental detokenizer and stop checks; finished requests
free their blocks at once (full blocks stay cached for prefix hits until evicted).

Finish reasons: "stop" (EOS, a stop token, a stop string: cut from the text, or a grammar that can only end: the
EOS it forces is not emitted), "length" (max_tokens; also max_tokens=0, which only computes the prompt), "abort",
"check_failed" (an exact JSON Schema check left no valid continuation and its retries are spent: the text is not a
valid answer), "dead_end" (the grammar allowed no token, e.g. a grammar backend's error: not an answer either).

Checked JSON Schemas (keywords the grammar widens, grammar/schema_relax.py): when a row's check leaves no valid
continuation, the request is rewound (grammar/retry.py's RowRetry, the policy generate() uses): its grammar state,
tokens, text and logprobs go back to the start of the failing value, its KV is cut there (Scheduler.rewind: blocks
past it are released, a kept block named in the prefix cache is copied before it is written again), the failing
continuation is forbidden, and it decodes on. Such a request's text is streamed only when it finishes (a rewind may
reach back to its first token); ``metrics["grammar_retries"]`` counts its rewinds.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from dataclasses import dataclass

import torch

from ..cache.manager import KVManager
from ..devices import resolve_device, resolve_dtype
from ..grammar.retry import RowRetry
from ..kv_memory import kv_cache_bytes
from ..speculative.drafters import ngram_lookup
from .detokenizer import IncrementalDetokenizer
from .grammar_link import mask_rows, request_grammar
from .memory import DEFAULT_KV_MEMORY, kv_budget
from .params import RequestOutput, SamplingParams, TokenLogprob
from .runner import ModelRunner
from .sampler import SamplingBatch, sample, token_logprobs
from .scheduler import Request, Scheduler

logger = logging.getLogger(__name__)


@dataclass
class _Output:
    """What the engine keeps per request besides the scheduler's Request: text, logprobs, stop handling."""

    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    stop_hold: int  # characters held back from streaming: a stop string may be starting there
    text: str = ""  # detok.text, cut at a stop string
    sent: int = 0  # len(text) already reported (new_text)
    stopped_at: int | None = None  # cut position of the stop string that ended the request
    retry: RowRetry | None = None  # checked JSON Schema: the rewind budget and forbidden continuations


class Engine:
    def __init__(self, model, tokenizer, *, max_batch_tokens: int = 512, block_size: int = 16,
                 max_memory: int | None = None, num_blocks: int | None = None, max_num_seqs: int = 64,
                 chunked_prefill: bool = True, prefill_chunk: int | None = None, prefix_caching: bool = True,
                 max_model_len: int | None = None, device: str | None = None, dtype: str | None = None,
                 memory_utilization: float | None = None):  # fmt: skip
        """max_model_len: the longest prompt + max_tokens accepted (default: config.max_position_embeddings; larger
        only for models known to extrapolate, e.g. RoPE ones in a benchmark).
        device / dtype: move the model there first ("auto": a CUDA GPU if any; the checkpoint's dtype, fp32 ones in
        bf16 on a GPU: devices.py); None: leave it where it is.
        The KV pool: num_blocks blocks, or max_memory bytes, or memory_utilization, a share of the device's memory
        less what is in use and a profiling forward's activations (memory.py); default 512 MiB."""
        if device is not None or dtype is not None:
            weight = next(model.parameters())
            place = resolve_device(device, "device") if device is not None else weight.device
            model.to(place, resolve_dtype(dtype, weight.dtype, place) if dtype is not None else weight.dtype)
        config = model.config.get_text_config(decoder=True)
        if max_model_len is not None and (not isinstance(max_model_len, int) or isinstance(max_model_len, bool)
                                          or max_model_len < 1):  # fmt: skip
            raise ValueError(f"Engine: max_model_len={max_model_len!r} must be a positive integer or None")
        for name, value in (("max_batch_tokens", max_batch_tokens), ("block_size", block_size),
                            ("max_num_seqs", max_num_seqs)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Engine: {name}={value!r} must be a positive integer")
        if memory_utilization is not None and (num_blocks is not None or max_memory is not None):
            raise ValueError(f"Engine: memory_utilization={memory_utilization!r} sizes the KV pool itself; give "
                             f"num_blocks={num_blocks!r} / max_memory={max_memory!r} or it, not both")  # fmt: skip
        self.memory_budget = None  # KVBudget when sized by memory_utilization
        if memory_utilization is not None:
            self.memory_budget = kv_budget(model, max_batch_tokens, max_num_seqs, memory_utilization)
            max_memory = self.memory_budget.kv_bytes
        dtype = next(model.parameters()).dtype
        state = kv_cache_bytes(config, 0, dtype=dtype)  # per sequence; 0 without constant-state layers
        self.block_bytes = kv_cache_bytes(config, block_size, dtype=dtype) - state  # one block, all attention layers
        if num_blocks is None:  # the memory holds the blocks and, for hybrid models, max_num_seqs constant states
            memory = max_memory if max_memory is not None else DEFAULT_KV_MEMORY
            block = self.block_bytes
            num_blocks = max(0, memory - max_num_seqs * state) // block
            if state and num_blocks < 2:
                raise ValueError(f"Engine: max_memory={memory} cannot hold the constant states of max_num_seqs="
                                 f"{max_num_seqs} sequences ({state} bytes each) and 2 blocks; raise max_memory or "
                                 "lower max_num_seqs")  # fmt: skip
        if num_blocks < 2:
            raise ValueError(f"Engine: max_memory={max_memory} holds {num_blocks} blocks; need at least 2")
        self.model, self.tokenizer = model, tokenizer
        self.runner = ModelRunner(model, num_blocks, block_size, max_num_seqs, chunked_prefill)
        kv = KVManager(block_size, num_blocks, self.runner.groups, prefix_caching,
                       state_slots=max_num_seqs if self.runner.states is not None else 0)  # fmt: skip
        self.scheduler = Scheduler(kv, max_batch_tokens, max_num_seqs, chunked_prefill, prefill_chunk)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.vocab_size = config.vocab_size
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", None)  # None: unbounded
        self.requests: dict[str, Request] = {}
        self._out: dict[str, _Output] = {}
        self.lock = threading.RLock()  # add_request / abort may come from other threads (the server)
        self._ids = itertools.count()
        self._aborted: list[RequestOutput] = []
        self.steps = 0

    @property
    def kv(self):
        """The scheduler's KV manager (block tables, prefix hits, preemption): read it, the scheduler changes it."""
        return self.scheduler.kv

    def kv_stats(self) -> dict:
        """The KV pool now: blocks total / used (referenced) / cached (kept for prefix hits) / free, and bytes."""
        blocks = self.kv.block_stats()
        bytes_total = self.block_bytes * self.kv.num_blocks
        return {**blocks, "bytes_total": bytes_total,
                "bytes_used": bytes_total * blocks["blocks_used"] // max(blocks["blocks_total"], 1),
                "device": str(next(self.model.parameters()).device),
                "sizing": self.memory_budget.to_dict() if self.memory_budget else None}  # fmt: skip

    # -- requests ----------------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:  # fmt: skip
        """Queue a request (validated now, before any work); returns its id. ValueError names the bad field."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)):
            prompt_ids = list(prompt)
        else:
            raise ValueError(f"prompt: expected text or a list of token ids, got {type(prompt).__name__}")
        ok = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in prompt_ids)
        if not prompt_ids or not ok:
            raise ValueError(f"prompt: expected a non-empty text or token ids in [0, {self.vocab_size}), got {prompt!r:.80}")
        limit = self.max_model_len
        if limit is not None and len(prompt_ids) > limit:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens exceed the model's context of {limit} tokens")
        if limit is not None and len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(f"max_tokens: the prompt's {len(prompt_ids)} tokens + max_tokens={params.max_tokens} = "
                             f"{len(prompt_ids) + params.max_tokens} exceed the model's context of {limit} tokens")  # fmt: skip
        block_size, usable = self.kv.block_size, self.kv.num_blocks - 1
        blocks = -(-(len(prompt_ids) + params.max_tokens) // block_size)
        if blocks > usable:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens={params.max_tokens} needs {blocks} "
                             f"blocks; the engine has {usable} (raise max_memory)")  # fmt: skip
        if params.num_speculative_tokens and self.runner.states is not None:
            raise ValueError(f"num_speculative_tokens={params.num_speculative_tokens}: speculative decoding rolls "
                             "rejected drafts back, which this model's constant-state layers cannot; use 0")
        grammar = None
        if params.response_format is not None or params.grammar is not None:
            grammar = request_grammar(self.tokenizer, self.eos_ids, params.response_format, params.grammar)
        out = _Output(IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens),
                      [] if params.logprobs is not None else None,
                      [None] * len(prompt_ids) if params.prompt_logprobs is not None else None,
                      max((len(s) for s in params.stop), default=1) - 1)  # fmt: skip
        if grammar is not None and grammar.retryable:  # checked: rewinds possible, text held
            out.retry, out.stop_hold = RowRetry(), sys.maxsize
        with self.lock:
            request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
            if not isinstance(request_id, str) or request_id in self.requests:
                raise ValueError(f"request_id={request_id!r} is already in use or not a string")
            request = Request(request_id, prompt_ids, params, grammar=grammar)
            if params.seed is not None:
                request.generator = torch.Generator().manual_seed(params.seed)
            self.requests[request_id] = request
            self._out[request_id] = out
            self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        with self.lock:
            request = self.requests.pop(request_id, None)
            if request is None:
                return
            self.scheduler.finish(request)
            request.finish_reason = "abort"
            self._aborted.append(self._output(request, finished=True))
            self._out.pop(request_id, None)

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
            keep, prompt_rows, samplers, start = [], [], [], 0
            for request, n in scheduled:
                out = self._out[request.id]
                if out.prompt_logprobs is not None:  # positions p predicting prompt token p + 1
                    stop = min(request.computed + n, len(request.prompt_ids) - 1)
                    for p in range(request.computed, stop):
                        prompt_rows.append((len(keep), request, p + 1))
                        keep.append(start + p - request.computed)
                if request.remaining == n:  # it reaches its end: its last token and every draft position
                    samplers.append((request, len(keep)))
                    keep.extend(range(start + n - 1 - len(request.draft), start + n))
                start += n
            logits = self.runner.forward(scheduled, keep)[:, : self.vocab_size]
            self.scheduler.update(scheduled)
            self._prompt_logprobs(logits, prompt_rows)
            outputs.extend(self._sample(logits, samplers))
            self.steps += 1
        return outputs

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

    def _propose_drafts(self) -> None:
        """n-gram lookup drafts for decoding requests that asked for speculation (verified in the same forward)."""
        for request in self.scheduler.running:
            k = min(request.params.num_speculative_tokens, request.params.max_tokens - len(request.generated) - 1)
            if k > 0 and request.grammar is None and request.computed == len(request.tokens) - 1:
                request.draft = ngram_lookup(torch.tensor(request.tokens), k).tolist()

    def _prompt_logprobs(self, logits: torch.Tensor, rows: list) -> None:
        """rows [(logits row, request, prompt index)] -> TokenLogprob of each prompt token (all rows at once)."""
        if not rows:
            return
        index = torch.tensor([r for r, _, _ in rows])
        targets = torch.tensor([request.prompt_ids[i] for _, request, i in rows])
        k = max(request.params.prompt_logprobs for _, request, _ in rows)
        for (_, request, i), entry in zip(rows, token_logprobs(logits[index], targets, k)):
            entry.top = entry.top[: request.params.prompt_logprobs]
            self._out[request.id].prompt_logprobs[i] = entry

    def _sample(self, logits: torch.Tensor, samplers: list) -> list[RequestOutput]:
        """Sample / verify every sampling request at once, append each one's tokens, report."""
        now = time.perf_counter()
        for request, _ in samplers:
            request.first_token_time = request.first_token_time or now
        finished = [(r, "length") for r, _ in samplers if r.params.max_tokens == 0]  # prefill only (echo)
        samplers = [(r, row) for r, row in samplers if r.params.max_tokens > 0]
        running = []
        if samplers:
            spans = [(row, 1 + len(r.draft)) for r, row in samplers]
            offsets = list(itertools.accumulate((n for _, n in spans[:-1]), initial=0))  # of each request's rows
            if sum(n for _, n in spans) == logits.shape[0]:  # only sampling rows were kept (no prompt logprobs)
                raw = logits
            else:
                raw = logits[torch.cat([torch.arange(row, row + n) for row, n in spans])]
            rows = raw
            constrained = [(i, r) for i, (r, _) in enumerate(samplers) if r.grammar is not None]
            rewound = set()
            if constrained:  # logprobs are of the raw distribution: mask a copy
                rows = raw.clone()
                matcher = mask_rows(rows, [offsets[i] for i, _ in constrained], [r.grammar for _, r in constrained])
                for j, (i, request) in enumerate(constrained):
                    if (matcher.finish_reason(j) or "").startswith("check_failed") and self._rewind(request):
                        rewound.add(i)  # its sample is dropped: it decodes again from the rewound point
            batch = SamplingBatch.build([r.params for r, _ in samplers], [r.generator for r, _ in samplers],
                                        [r.draft for r, _ in samplers], rows.shape[-1])  # fmt: skip
            wanted = []
            for i, ((request, _), tokens) in enumerate(zip(samplers, sample(rows, batch).tokens)):
                if i in rewound:
                    running.append((request, None))
                    continue
                drafts = len(request.draft)
                request.proposed, request.accepted = request.proposed + drafts, request.accepted + len(tokens) - 1
                self.scheduler.drop_drafts(request, len(tokens) - 1)
                taken, reason = self._append(request, tokens)
                if request.params.logprobs is not None:
                    wanted.extend((offsets[i] + j, request, t) for j, t in enumerate(tokens[:taken]))
                (running if reason is None else finished).append((request, reason))
            self._logprobs(raw, wanted)
        outputs = [self._output(request, finished=False) for request, _ in running]
        for request, reason in finished:
            request.finish_reason = reason
            self.scheduler.finish(request)
            self.requests.pop(request.id, None)
            outputs.append(self._output(request, finished=True))
            del self._out[request.id]
        return outputs

    def _logprobs(self, raw: torch.Tensor, wanted: list) -> None:
        """wanted [(raw row, request, token)] -> append the tokens' TokenLogprob to their requests (one batched op)."""
        if not wanted:
            return
        k = max(request.params.logprobs for _, request, _ in wanted)
        entries = token_logprobs(raw[torch.tensor([w[0] for w in wanted])], torch.tensor([w[2] for w in wanted]), k)
        for (_, request, _), entry in zip(wanted, entries):
            entry.top = entry.top[: request.params.logprobs]
            self._out[request.id].logprobs.append(entry)

    def _rewind(self, request: Request) -> bool:
        """A checked grammar left `request` no valid continuation: rewind it to the start of the failing value with
        the failing continuation forbidden (module docstring). False when its retries are spent."""
        out, state = self._out[request.id], request.grammar
        keep = out.retry.plan(state, request.params.max_tokens) if out.retry is not None else None
        if keep is None:
            return False
        logger.info("request %s: %s; retry %d from token %d", request.id, state.dead_reason, out.retry.retries, keep)
        out.retry.rewind(state, keep)
        del request.generated[keep:]
        self.scheduler.rewind(request, len(request.tokens) - 1)  # the last kept token is computed again
        out.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids, request.params.skip_special_tokens)
        for token in request.generated:
            out.detok.add(token)
        out.text = out.detok.text
        if out.logprobs is not None:
            del out.logprobs[keep:]
        return True

    def _append(self, request: Request, tokens: list[int]) -> tuple[int, str | None]:
        """Append tokens up to the first that ends the request -> (tokens taken, finish reason or None)."""
        params, out = request.params, self._out[request.id]
        for taken, token in enumerate(tokens, 1):
            request.generated.append(token)
            if request.grammar is not None:
                request.grammar.accept_tokens([token])
            out.detok.add(token)
            reason = None
            if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
                reason = "stop"
            elif len(request.generated) >= params.max_tokens:
                reason = "length"
            elif request.grammar is not None and request.grammar.is_terminated():
                reason = "stop"
            if reason == "stop" and request.grammar is not None and request.grammar.dead_at is not None:
                # no valid continuation (a failed JSON Schema check, or the backend's error): not an answer
                reason = "check_failed" if request.grammar.dead_reason.startswith("check_failed") else "dead_end"
            if reason is not None:
                out.detok.flush()
            if params.stop and (cut := _find_stop(out.detok.text, params.stop, len(out.text))) is not None:
                out.stopped_at, reason = cut, "stop"
            out.text = out.detok.text if out.stopped_at is None else out.detok.text[: out.stopped_at]
            if reason is not None:
                return taken, reason
        return len(tokens), None

    def _output(self, request: Request, finished: bool) -> RequestOutput:
        out = self._out[request.id]
        text = out.text if finished else out.text[: max(out.sent, len(out.text) - out.stop_hold)]
        new_text, out.sent = text[out.sent :], len(text)
        return RequestOutput(
            request.id, request.prompt_ids, list(request.generated), text, finished, request.finish_reason,
            list(out.logprobs) if out.logprobs is not None else None, new_text, request.prefix_hit_tokens,
            {"arrival": request.arrival, "first_token": request.first_token_time, "preemptions": request.preemptions,
             "speculative_proposed": request.proposed, "speculative_accepted": request.accepted,
             "grammar_retries": out.retry.retries if out.retry is not None else 0,
             "finished": time.perf_counter() if finished else None},
            list(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
            out.detok.offsets[: len(request.generated)],
        )  # fmt: skip


def _find_stop(text: str, stops: list[str], searched: int) -> int | None:
    """Index of the earliest stop string that ends in the new part of text (after `searched`), or None."""
    start = max(0, searched - max(len(s) for s in stops) + 1)
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None
