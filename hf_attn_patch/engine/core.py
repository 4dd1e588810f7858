"""The engine: the request API and the step loop, a coordinator of values.

    engine = Engine(model, tokenizer, max_batch_tokens=512, block_size=16, max_memory=2**30)
    outputs = engine.generate(["Once upon a time", "The cat"], SamplingParams(max_tokens=64, temperature=0))
    rid = engine.add_request("Hello", SamplingParams(max_tokens=8)); for out in engine.stream(): ...

A step hands values from one owner to the next:

    Scheduler.schedule() ------------> SchedulerOutput (the plan: request ids, tokens, block tables, logits rows,
      |  places requests, proposes        |             sampling views with drafts, prompt-logprob rows)
      |  n-gram drafts                    v
      |                  OutputProcessor.grammar_masks(plan) --> GrammarMasks (constrained rows' bitmask)
      |                                   |
      |                                   v
      |                  ModelRunner.execute(plan, masks) -----> ModelRunnerOutput (per request id: drawn
      |                    one packed forward, masks, draws         tokens, their logprobs, prompt logprobs)
      |                    and verifies drafts, logprobs            |
      v                                                             v
    Scheduler.update / drop_drafts /  <--- OutputProcessor.update_from_output(plan, result) ---> [RequestOutput]
      rewind / finish                       appends, detokenizes, stops, rewinds, finishes

Only the scheduler and the output processor change a request (request.py says which fields each writes); the
runner reads the plan and answers with a value. Finish reasons and checked-schema rewinds: output_processor.py.
"""

from __future__ import annotations

import itertools
import threading

import torch

from ..cache.manager import KVManager
from ..devices import resolve_device, resolve_dtype
from .grammar_link import request_grammar
from .memory import kv_budget, pool_blocks
from .output_processor import OutputProcessor
from .params import RequestOutput, SamplingParams
from .request import Request
from .runner import ModelRunner
from .scheduler import Scheduler
from .validation import check_engine_args, request_prompt_ids


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch_tokens: int = 512,
        block_size: int = 16,
        max_memory: int | None = None,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        chunked_prefill: bool = True,
        prefill_chunk: int | None = None,
        prefix_caching: bool = True,
        max_model_len: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        memory_utilization: float | None = None,
    ):
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
        check_engine_args(
            max_model_len, max_batch_tokens, block_size, max_num_seqs, memory_utilization, num_blocks, max_memory
        )
        self.memory_budget = None  # KVBudget when sized by memory_utilization
        if memory_utilization is not None:
            self.memory_budget = kv_budget(model, max_batch_tokens, max_num_seqs, memory_utilization)
            max_memory = self.memory_budget.kv_bytes
        dtype = next(model.parameters()).dtype
        num_blocks, self.block_bytes = pool_blocks(config, dtype, block_size, max_num_seqs, num_blocks, max_memory)
        self.model, self.tokenizer = model, tokenizer
        self.runner = ModelRunner(model, num_blocks, block_size, max_num_seqs, chunked_prefill)
        slots = max_num_seqs if self.runner.states is not None else 0
        kv = KVManager(block_size, num_blocks, self.runner.groups, prefix_caching, state_slots=slots)
        self.scheduler = Scheduler(kv, max_batch_tokens, max_num_seqs, chunked_prefill, prefill_chunk)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.vocab_size = config.vocab_size
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", None)  # None: unbounded
        self.processor = OutputProcessor(self.scheduler, tokenizer, self.eos_ids, self.vocab_size)
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
        return {
            **blocks,
            "bytes_total": bytes_total,
            "bytes_used": bytes_total * blocks["blocks_used"] // max(blocks["blocks_total"], 1),
            "device": str(next(self.model.parameters()).device),
            "sizing": self.memory_budget.to_dict() if self.memory_budget else None,
        }

    # -- requests ----------------------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request (validated now, before any work); returns its id. ValueError names the bad field."""
        params = params if params is not None else SamplingParams()
        hybrid = self.runner.states is not None
        prompt_ids = request_prompt_ids(
            prompt, params, self.tokenizer, self.vocab_size, self.max_model_len, self.kv, hybrid
        )
        grammar = None
        if params.response_format is not None or params.grammar is not None:
            grammar = request_grammar(self.tokenizer, self.eos_ids, params.response_format, params.grammar)
        with self.lock:
            request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
            if not isinstance(request_id, str) or request_id in self.scheduler.requests:
                raise ValueError(f"request_id={request_id!r} is already in use or not a string")
            generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            request = Request(request_id, prompt_ids, params, generator=generator, grammar=grammar)
            self.processor.add(request)
            self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        with self.lock:
            output = self.processor.abort(request_id)
            if output is not None:
                self._aborted.append(output)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests)

    # -- running -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: plan, one packed forward and its draws, the result applied (module docstring); the outputs of
        requests that gained tokens or finished."""
        with self.lock:
            outputs, self._aborted = self._aborted, []
            plan = self.scheduler.schedule()
            if not plan:
                return outputs
            result = self.runner.execute(plan, self.processor.grammar_masks(plan))
            outputs.extend(self.processor.update_from_output(plan, result))
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
