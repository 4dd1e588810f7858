"""What every route shares: the engine thread, the tokenizer, the model's limits, and the request plumbing (bounded
body reading, tokenization, the context budget, submitting a request's choices and waiting for them)."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..grammar.errors import GrammarError
from .engine_thread import EngineThread
from .protocol import APIError, TokenText, bad

DEFAULT_MAX_TOKENS = 256  # when a request sends none (cut to what the context leaves)
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks that its client is still there


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class ServingContext:
    """One server's state (app.state.serving); the routes read it from their request."""

    def __init__(self, engine, model_name: str, max_queue: int, drain_timeout: float, max_body_bytes: int):
        self.engine, self.model_name = engine, model_name
        self.drain_timeout, self.max_body_bytes = drain_timeout, max_body_bytes
        self.thread = EngineThread(engine, max_queue)
        self.tokenizer = engine.tokenizer
        self.token_text = TokenText(self.tokenizer)
        self.limit = engine.max_model_len  # the model's context (None: unbounded)
        self.vocab_size = engine.vocab_size
        self.block_size = engine.kv.block_size

    async def read_json(self, request: Request) -> dict:
        """The body as a JSON object, read no further than max_body_bytes (413), parsed off the event loop."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise APIError(
                413,
                f"the request body has {length} bytes; the limit is max_body_bytes={limit}",
                kind="request_too_large",
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body exceeds max_body_bytes={limit}", kind="request_too_large")
            chunks.append(chunk)
        try:
            body = await run_in_threadpool(_parse_json, b"".join(chunks))
        except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8, a 5000-digit number, deep nesting
            raise APIError(400, f"the request body is not valid JSON: {str(error)[:200]!a}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("model", f"expected a string, got {type(model).__name__}")
        if model not in (None, self.model_name):
            raise APIError(
                404,
                f"model={model!r:.100} does not exist; this server has {self.model_name!r}",
                "model",
                "model_not_found",
            )
        return body

    def budget(self, ids: list[int], max_tokens: int | None, where: str) -> int:
        """The prompt and max_tokens against the context -> max_tokens to run (a default fits what is left)."""
        limit = self.limit
        if limit is None:
            return DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        if len(ids) > limit or (max_tokens is None and len(ids) >= limit):
            raise bad("prompt", f"{where} has {len(ids)} tokens; the model's context is {limit} tokens")
        if max_tokens is None:
            return min(DEFAULT_MAX_TOKENS, limit - len(ids))
        if len(ids) + max_tokens > limit:
            raise bad(
                "max_tokens",
                f"{where} of {len(ids)} tokens + max_tokens={max_tokens} = {len(ids) + max_tokens}"
                f" tokens exceeds the model's context of {limit} tokens",
            )
        return max_tokens

    async def tokenize(self, text: str, special: bool, param: str) -> list[int]:
        try:
            return (await run_in_threadpool(self.tokenizer, text, add_special_tokens=special)).input_ids
        except Exception as error:  # the tokenizer refused the text
            raise bad(param, f"cannot be tokenized: {type(error).__name__}: {str(error)[:200]}") from None

    async def submit(self, jobs: list[tuple[list[int], object]], name: str, grammar_param: str):
        """jobs [(prompt ids, SamplingParams)] -> (request ids, shared queue); all or none are queued."""
        thread = self.thread
        thread.reserve(len(jobs))  # routes + reserved counts a request twice while it is added: conservative
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        ids, added = [f"{name}-{i}" for i in range(len(jobs))], []
        # A prompt that several choices share (n > 1, or repeated prompts) is computed once: its first choice goes
        # first, the others join when its prompt blocks are in the prefix cache (after one step).
        first: dict[tuple, int] = {}
        for i, (prompt_ids, _) in enumerate(jobs):
            first.setdefault(tuple(prompt_ids), i)
        leaders = [
            i
            for i in first.values()
            if sum(1 for p, _ in jobs if p == jobs[i][0]) > 1 and len(jobs[i][0]) >= self.block_size
        ]
        order = leaders + [i for i in range(len(jobs)) if i not in leaders]
        try:
            waits = []
            for position, i in enumerate(order):
                if position == len(leaders) and waits:
                    await asyncio.wait(waits, timeout=30)
                started = loop.create_future() if i in leaders else None
                waits += [started] if started is not None else []
                await run_in_threadpool(thread.add, ids[i], jobs[i][0], jobs[i][1], loop, queue, started)
                added.append(ids[i])
        except GrammarError as error:
            thread.abort(added)
            raise bad(grammar_param, str(error)) from None
        except ValueError as error:  # the engine's own checks (KV blocks for prompt + max_tokens)
            thread.abort(added)
            raise bad("max_tokens" if "max_tokens" in str(error) else "prompt", str(error)) from None
        except BaseException:
            thread.abort(added)
            raise
        finally:
            thread.release(len(jobs))
        return ids, queue

    async def wait_all(self, request: Request, ids: list[str], queue: asyncio.Queue) -> dict:
        """Final output of every request id; aborts them all if the client disconnects first."""
        finals, getter = {}, None
        checked = time.monotonic()
        try:
            while len(finals) < len(ids):
                getter = getter or asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter}, timeout=POLL_SECONDS)
                if getter in done:
                    out, getter = getter.result(), None
                    if out.finished:
                        finals[out.request_id] = out
                # checked by the clock, not only when idle: a busy request gets an output every step
                if time.monotonic() - checked >= POLL_SECONDS:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise ClientGone()
        except (ClientGone, asyncio.CancelledError):
            self.thread.abort(ids)
            raise
        finally:
            if getter is not None:
                getter.cancel()
        if any(out.finish_reason == "abort" for out in finals.values()) and not self.thread.accepting:
            raise APIError(
                503,
                f"the server shut down; the request was aborted after drain_timeout={self.drain_timeout} s",
                kind="service_unavailable",
            )
        return finals


def sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


def _parse_json(raw: bytes):
    """json.loads, refusing text no tokenizer can take: an unpaired UTF-16 surrogate ("\\ud800") is valid JSON."""
    body = json.loads(raw)
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("it contains an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape)") from None
    return body
