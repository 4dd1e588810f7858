"""Applying a step's result: the one place a request gains tokens, text and an end.

    masks = processor.grammar_masks(plan)               # before the forward: constrained requests' next-token masks
    outputs = processor.update_from_output(plan, result)  # after it: plan (SchedulerOutput) + ModelRunnerOutput

The processor owns what a request has produced: its tokens (`Request.generated`), its grammar state's advance and
its text state here (the incremental detokenizer, the text cut at a stop string, logprobs, prompt logprobs, the
part already streamed, a checked schema's rewind budget). Where a request's KV stands stays the scheduler's: this
module asks it to mark the step computed, drop rejected drafts, cut the KV at a rewind and free a finished request.

update_from_output, per request that reached its next token: a request whose checked JSON Schema left no valid
continuation is rewound (below) and its draw dropped; otherwise the accepted drafts and the next token are appended
one at a time (grammar advance, detokenize, stop checks) up to the first that ends it, with their logprobs.

Finish reasons: "stop" (EOS, a stop token, a stop string: cut from the text, or a grammar that can only end: the
EOS it forces is not emitted), "length" (max_tokens; also max_tokens=0, which only computes the prompt), "abort",
"check_failed" (an exact JSON Schema check left no valid continuation and its retries are spent: the text is not a
valid answer), "dead_end" (the grammar allowed no token, e.g. a grammar backend's error: not an answer either).

Checked JSON Schemas (keywords the grammar widens, grammar/schema_relax.py): when a request's check leaves no valid
continuation, it is rewound (grammar/retry.py's RowRetry, the policy generate() uses): its grammar state, tokens,
text and logprobs go back to the start of the failing value, its KV is cut there (Scheduler.rewind: blocks past it
are released, a kept block named in the prefix cache is copied before it is written again), the failing
continuation is forbidden, and it decodes on. Such a request's text is streamed only when it finishes (a rewind may
reach back to its first token); ``metrics["grammar_retries"]`` counts its rewinds.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from ..grammar.retry import RowRetry
from .detokenizer import IncrementalDetokenizer
from .grammar_link import GrammarMasks, check_failed, grammar_masks
from .params import RequestOutput, TokenLogprob
from .request import Request
from .runner_output import ModelRunnerOutput
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class RequestText:
    """A request's text state: what it reads as and what was streamed of it."""

    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    stop_hold: int  # characters held back from streaming: a stop string may be starting there
    text: str = ""  # detok.text, cut at a stop string
    sent: int = 0  # len(text) already reported (new_text)
    stopped_at: int | None = None  # cut position of the stop string that ended the request
    retry: RowRetry | None = None  # checked JSON Schema: the rewind budget and forbidden continuations


class OutputProcessor:
    """Per request id its RequestText; the requests themselves are the scheduler's (Scheduler.requests)."""

    def __init__(self, scheduler: Scheduler, tokenizer, eos_ids: set[int], vocab_size: int):
        self.scheduler, self.tokenizer, self.eos_ids, self.vocab_size = scheduler, tokenizer, eos_ids, vocab_size
        self.texts: dict[str, RequestText] = {}

    def add(self, request: Request) -> None:
        """Start the text state of a request the scheduler has just been given."""
        params = request.params
        text = RequestText(
            IncrementalDetokenizer(self.tokenizer, request.prompt_ids, params.skip_special_tokens),
            [] if params.logprobs is not None else None,
            [None] * len(request.prompt_ids) if params.prompt_logprobs is not None else None,
            max((len(s) for s in params.stop), default=1) - 1,
        )
        if request.grammar is not None and request.grammar.retryable:  # checked: rewinds possible, text held
            text.retry, text.stop_hold = RowRetry(), sys.maxsize
        self.texts[request.id] = text

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish an unfinished request as "abort" -> its final output (None for an unknown or finished id)."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request)
        request.finish_reason = "abort"
        output = self._output(request, finished=True)
        del self.texts[request_id]
        return output

    def grammar_masks(self, plan: SchedulerOutput) -> GrammarMasks | None:
        """The next-token masks of the plan's constrained requests that draw a token (None when there are none)."""
        requests = self.scheduler.requests
        ids = [i for i, view in plan.sampling.items() if view.params.max_tokens > 0 and requests[i].grammar is not None]
        if not ids:
            return None
        return grammar_masks(ids, [requests[i].grammar for i in ids], self.vocab_size)

    def update_from_output(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply a step's result (module docstring) -> the outputs of requests that gained tokens or finished."""
        requests = self.scheduler.requests
        self.scheduler.update(plan)
        for request_id, entries in result.prompt_logprobs.items():
            first = plan.prompt_logprobs[request_id].first
            self.texts[request_id].prompt_logprobs[first : first + len(entries)] = entries
        now = time.perf_counter()
        running, finished = [], []
        for request_id, view in plan.sampling.items():
            request = requests[request_id]
            request.first_token_time = request.first_token_time or now
            if view.params.max_tokens == 0:  # prefill only (echo)
                finished.append((request, "length"))
        for request_id, tokens in result.sampled.items():
            request, text = requests[request_id], self.texts[request_id]
            if request.grammar is not None and check_failed(request.grammar) and self._rewind(request):
                running.append(request)  # its draw is dropped: it decodes again from the rewound point
                continue
            request.proposed += len(plan.sampling[request_id].draft)
            request.accepted += len(tokens) - 1
            self.scheduler.drop_drafts(request, len(tokens) - 1)
            taken, reason = self._append(request, tokens)
            if text.logprobs is not None:
                text.logprobs.extend(result.logprobs[request_id][:taken])
            if reason is None:
                running.append(request)
            else:
                finished.append((request, reason))
        outputs = [self._output(request, finished=False) for request in running]
        for request, reason in finished:
            request.finish_reason = reason
            self.scheduler.finish(request)
            outputs.append(self._output(request, finished=True))
            del self.texts[request.id]
        return outputs

    def _append(self, request: Request, tokens: tuple[int, ...]) -> tuple[int, str | None]:
        """Append tokens up to the first that ends the request -> (tokens taken, finish reason or None)."""
        params, text = request.params, self.texts[request.id]
        for taken, token in enumerate(tokens, 1):
            request.generated.append(token)
            if request.grammar is not None:
                request.grammar.accept_tokens([token])
            text.detok.add(token)
            reason = None
            if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
                reason = "stop"
            elif len(request.generated) >= params.max_tokens:
                reason = "length"
            elif request.grammar is not None and request.grammar.is_terminated():
                reason = "stop"
            if reason == "stop" and request.grammar is not None and request.grammar.dead_at is not None:
                # no valid continuation (a failed JSON Schema check, or the backend's error): not an answer
                reason = "check_failed" if check_failed(request.grammar) else "dead_end"
            if reason is not None:
                text.detok.flush()
            if params.stop and (cut := _find_stop(text.detok.text, params.stop, len(text.text))) is not None:
                text.stopped_at, reason = cut, "stop"
            text.text = text.detok.text if text.stopped_at is None else text.detok.text[: text.stopped_at]
            if reason is not None:
                return taken, reason
        return len(tokens), None

    def _rewind(self, request: Request) -> bool:
        """A checked grammar left `request` no valid continuation: rewind it to the start of the failing value with
        the failing continuation forbidden (module docstring). False when its retries are spent."""
        text, state = self.texts[request.id], request.grammar
        keep = text.retry.plan(state, request.params.max_tokens) if text.retry is not None else None
        if keep is None:
            return False
        logger.info("request %s: %s; retry %d from token %d", request.id, state.dead_reason, text.retry.retries, keep)
        text.retry.rewind(state, keep)
        del request.generated[keep:]
        self.scheduler.rewind(request, len(request.tokens) - 1)  # the last kept token is computed again
        text.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids, request.params.skip_special_tokens)
        for token in request.generated:
            text.detok.add(token)
        text.text = text.detok.text
        if text.logprobs is not None:
            del text.logprobs[keep:]
        return True

    def _output(self, request: Request, finished: bool) -> RequestOutput:
        state = self.texts[request.id]
        text = state.text if finished else state.text[: max(state.sent, len(state.text) - state.stop_hold)]
        new_text, state.sent = text[state.sent :], len(text)
        metrics = {
            "arrival": request.arrival,
            "first_token": request.first_token_time,
            "preemptions": request.preemptions,
            "speculative_proposed": request.proposed,
            "speculative_accepted": request.accepted,
            "grammar_retries": state.retry.retries if state.retry is not None else 0,
            "finished": time.perf_counter() if finished else None,
        }
        return RequestOutput(
            request.id,
            request.prompt_ids,
            list(request.generated),
            text,
            finished,
            request.finish_reason,
            list(state.logprobs) if state.logprobs is not None else None,
            new_text,
            request.prefix_hit_tokens,
            metrics,
            list(state.prompt_logprobs) if state.prompt_logprobs is not None else None,
            state.detok.offsets[: len(request.generated)],
        )


def _find_stop(text: str, stops: list[str], searched: int) -> int | None:
    """Index of the earliest stop string that ends in the new part of text (after `searched`), or None."""
    start = max(0, searched - max(len(s) for s in stops) + 1)
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None
