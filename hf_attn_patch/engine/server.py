"""OpenAI-compatible HTTP server over the Engine (FastAPI + uvicorn, the `serve` extra).

    hf-attn serve MODEL [--host 127.0.0.1 --port 8000 --max-queue 256 --drain-timeout 10 --max-body-bytes 8388608]

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, GET /health.
Request fields are validated in openai_protocol.py (tools in tools.py); what this module adds is the HTTP side:
  - one background thread runs engine steps; each HTTP request waits on its own asyncio queue, fed by that thread;
  - bodies above `max_body_bytes` are refused (413) while being read, before parsing; JSON parsing, tokenization,
    chat templates and the engine's add_request (grammar compilation) run in the threadpool, off the event loop;
  - a prompt longer than the model's context, or prompt + max_tokens beyond it, is a 400 naming both numbers;
  - a non-streaming client that disconnects aborts its requests (polled every 0.25 s), a streaming one too;
  - SIGTERM / Ctrl-C: stop accepting (503), let in-flight requests run for `drain_timeout` seconds, then abort the
    rest (a streamed choice gets a final chunk with finish_reason "abort", a waiting one a 503) and exit.
Errors: {"error": {"message", "type", "param", "code"}}: 400 invalid field (named in `param`), 404 unknown model or
route, 413 body too large, 429 queue full (waiting + running requests >= max_queue), 503 shutting down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..grammar.errors import GrammarError
from .detokenizer import IncrementalDetokenizer
from .openai_protocol import (
    APIError,
    TokenText,
    bad,
    chat_logprobs,
    completion_logprobs,
    parse_chat,
    parse_completion,
    usage,
)
from .tools import ToolPlan, parse_output, read_tools

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # when a request sends none (cut to what the context leaves)
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks that its client is still there


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class EngineRunner:
    """Runs engine steps on a background thread and routes each output to its request's asyncio queue."""

    def __init__(self, engine, max_queue: int):
        self.engine, self.max_queue = engine, max_queue
        self.routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.reserved = 0  # slots promised to requests still being tokenized / added
        self.started: dict[str, asyncio.Future] = {}  # request id -> resolved at its first output
        self.accepting = True
        self.drain_deadline: float | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="hf-attn-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return len(self.routes) + self.reserved

    def reserve(self, count: int) -> None:
        """Claim `count` queue slots now (on the event loop), or raise 503 / 429."""
        if not self.accepting:
            raise APIError(503, "the server is shutting down", kind="service_unavailable")
        with self._lock:
            if self.in_flight + count > self.max_queue:
                raise APIError(429, f"too many requests in flight ({self.in_flight} + {count} > max_queue="
                                    f"{self.max_queue})", kind="rate_limit_exceeded")  # fmt: skip
            self.reserved += count

    def release(self, count: int) -> None:
        with self._lock:
            self.reserved -= count

    def add(self, request_id: str, prompt_ids: list[int], params, loop, queue, started=None) -> None:
        """Called in the threadpool for a reserved slot: queue one request in the engine, outputs to `queue`;
        `started` (an asyncio future) is resolved when its first output (prompt computed) is routed."""
        with self._lock:
            self.routes[request_id] = (loop, queue)
            if started is not None:
                self.started[request_id] = started
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except Exception:
            with self._lock:
                self.routes.pop(request_id, None)
            raise
        self._wake.set()

    def abort(self, request_ids) -> None:
        for request_id in request_ids:
            if request_id in self.routes:
                self.engine.abort(request_id)
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
            if self.drain_deadline is not None and time.monotonic() > self.drain_deadline and self.routes:
                logger.warning("drain timeout: aborting %d requests", len(self.routes))
                self.abort(list(self.routes))
            try:
                outputs = self.engine.step()
            except Exception:  # a failed step must not hang the clients: fail every waiting request
                logger.exception("engine step failed")
                self.abort(list(self.routes))
                outputs = self.engine.step()
            for out in outputs:
                target = self.routes.get(out.request_id)
                if target is None:
                    continue
                loop, queue = target
                with self._lock:
                    if out.finished:
                        self.routes.pop(out.request_id, None)
                    started = self.started.pop(out.request_id, None)
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, out)
                    if started is not None:
                        loop.call_soon_threadsafe(_resolve, started)
                except RuntimeError:  # the event loop is closed (the server is gone)
                    pass

    def begin_drain(self, seconds: float) -> None:
        """Stop accepting; requests still running after `seconds` are aborted by the engine thread."""
        if self.accepting:
            logger.info("draining %d in-flight requests for at most %.1f s", self.in_flight, seconds)
        self.accepting = False
        self.drain_deadline = time.monotonic() + seconds if self.drain_deadline is None else self.drain_deadline
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)


def create_app(engine, model_name: str, max_queue: int = 256, drain_timeout: float = 10.0,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):  # fmt: skip
    """The FastAPI app. The engine thread starts now; the app's shutdown drains it (see the module docstring)."""
    runner = EngineRunner(engine, max_queue)
    tokenizer = engine.tokenizer
    token_text = TokenText(tokenizer)
    limit = engine.max_model_len  # the model's context (None: unbounded)
    vocab_size = engine.vocab_size
    block_size = engine.kv.block_size

    @asynccontextmanager
    async def lifespan(app):
        yield
        runner.begin_drain(drain_timeout)
        while runner.routes and time.monotonic() < runner.drain_deadline + 5:
            await asyncio.sleep(0.02)
        runner.stop()

    app = FastAPI(title="hf-attn-patch", lifespan=lifespan)
    app.state.runner = runner
    app.state.drain_timeout = drain_timeout

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientGone)
    async def client_gone(request, error: ClientGone):  # its requests are aborted; nobody reads this answer
        logger.info("client disconnected from %s: its requests were aborted", request.url.path)
        return JSONResponse(APIError(499, "client closed the request", None, "client_closed").body(), status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(APIError(error.status_code, message, None, kind).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):  # a bug: still the OpenAI shape, and logged
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(error).__name__}", None, "server_error").body(),
                            status_code=500)  # fmt: skip

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            raise APIError(413, f"the request body has {length} bytes; the limit is max_body_bytes={max_body_bytes}",
                           kind="request_too_large")  # fmt: skip
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise APIError(413, f"the request body exceeds max_body_bytes={max_body_bytes}",
                               kind="request_too_large")  # fmt: skip
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
        if model not in (None, model_name):
            raise APIError(404, f"model={model!r:.100} does not exist; this server has {model_name!r}", "model",
                           "model_not_found")  # fmt: skip
        return body

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "local", "max_model_len": limit}

    def pool_stats() -> dict:
        with engine.lock:  # a consistent view between two engine steps
            return engine.kv_stats()

    @app.get("/health")
    async def health():
        return {"status": "ok" if runner.accepting else "shutting_down", "in_flight": runner.in_flight,
                "kv_cache": await run_in_threadpool(pool_stats)}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r:.100} does not exist; this server has {model_name!r}", "model",
                           "model_not_found")  # fmt: skip
        return model_card()

    def budget(ids: list[int], max_tokens: int | None, where: str) -> int:
        """The prompt and max_tokens against the context -> max_tokens to run (a default fits what is left)."""
        if limit is None:
            return DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        if len(ids) > limit or (max_tokens is None and len(ids) >= limit):
            raise bad("prompt", f"{where} has {len(ids)} tokens; the model's context is {limit} tokens")
        if max_tokens is None:
            return min(DEFAULT_MAX_TOKENS, limit - len(ids))
        if len(ids) + max_tokens > limit:
            raise bad("max_tokens", f"{where} of {len(ids)} tokens + max_tokens={max_tokens} = {len(ids) + max_tokens}"
                                    f" tokens exceeds the model's context of {limit} tokens")  # fmt: skip
        return max_tokens

    async def submit(jobs: list[tuple[list[int], object]], name: str, grammar_param: str):
        """jobs [(prompt ids, SamplingParams)] -> (request ids, shared queue); all or none are queued."""
        runner.reserve(len(jobs))  # routes + reserved counts a request twice while it is added: conservative
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        ids, added = [f"{name}-{i}" for i in range(len(jobs))], []
        # A prompt that several choices share (n > 1, or repeated prompts) is computed once: its first choice goes
        # first, the others join when its prompt blocks are in the prefix cache (after one step).
        first: dict[tuple, int] = {}
        for i, (prompt_ids, _) in enumerate(jobs):
            first.setdefault(tuple(prompt_ids), i)
        leaders = [i for i in first.values() if sum(1 for p, _ in jobs if p == jobs[i][0]) > 1
                   and len(jobs[i][0]) >= block_size]  # fmt: skip
        order = leaders + [i for i in range(len(jobs)) if i not in leaders]
        try:
            waits = []
            for position, i in enumerate(order):
                if position == len(leaders) and waits:
                    await asyncio.wait(waits, timeout=30)
                started = loop.create_future() if i in leaders else None
                waits += [started] if started is not None else []
                await run_in_threadpool(runner.add, ids[i], jobs[i][0], jobs[i][1], loop, queue, started)
                added.append(ids[i])
        except GrammarError as error:
            runner.abort(added)
            raise bad(grammar_param, str(error)) from None
        except ValueError as error:  # the engine's own checks (KV blocks for prompt + max_tokens)
            runner.abort(added)
            raise bad("max_tokens" if "max_tokens" in str(error) else "prompt", str(error)) from None
        except BaseException:
            runner.abort(added)
            raise
        finally:
            runner.release(len(jobs))
        return ids, queue

    async def wait_all(request: Request, ids: list[str], queue: asyncio.Queue) -> dict:
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
            runner.abort(ids)
            raise
        finally:
            if getter is not None:
                getter.cancel()
        if any(out.finish_reason == "abort" for out in finals.values()) and not runner.accepting:
            raise APIError(503, f"the server shut down; the request was aborted after drain_timeout={drain_timeout} s",
                           kind="service_unavailable")  # fmt: skip
        return finals

    async def tokenize(text: str, special: bool, param: str) -> list[int]:
        try:
            return (await run_in_threadpool(tokenizer, text, add_special_tokens=special)).input_ids
        except Exception as error:  # the tokenizer refused the text
            raise bad(param, f"cannot be tokenized: {type(error).__name__}: {str(error)[:200]}") from None

    # -- /v1/completions -----------------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        req = parse_completion(body, vocab_size)
        common = req.common
        prompts = [await tokenize(p, True, "prompt") if isinstance(p, str) else list(p) for p in req.prompts]
        jobs = []
        for i, ids in enumerate(prompts):
            if not ids:
                raise bad("prompt", f"prompt[{i}] has no tokens")
            max_tokens = budget(ids, common.max_tokens, f"prompt[{i}]" if len(prompts) > 1 else "the prompt")
            jobs += [(ids, common.sampling(max_tokens, j)) for j in range(common.n)]
        name = f"cmpl-{uuid.uuid4().hex[:24]}"
        ids, queue = await submit(jobs, name, "response_format")
        echoes = [await run_in_threadpool(_echo, tokenizer, p) for p in prompts] if req.echo else None
        head = {"id": name, "object": "text_completion", "created": int(time.time()), "model": model_name}
        if common.stream:
            return StreamingResponse(stream_completion(ids, queue, head, req, echoes, prompts),
                                     media_type="text/event-stream")  # fmt: skip
        finals = await wait_all(request, ids, queue)
        choices = [await run_in_threadpool(completion_choice, i, finals[rid], req, echoes and echoes[i // common.n])
                   for i, rid in enumerate(ids)]  # fmt: skip
        completion = sum(len(finals[rid].token_ids) for rid in ids)
        return dict(head, choices=choices, usage=usage(sum(map(len, prompts)), completion))

    def completion_choice(index: int, out, req, echo) -> dict:
        text, logprobs = out.text, None
        if req.common.logprobs is not None:
            pieces = _pieces(out.text, out.token_offsets, len(out.token_ids))
            entries = list(out.logprobs or [])
            if echo is not None:
                pieces, entries = echo[1] + pieces, list(out.prompt_logprobs or [None] * len(echo[1])) + entries
            logprobs = completion_logprobs(entries, token_text, pieces, 0)
        if echo is not None:
            text = echo[0] + text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}

    async def stream_completion(ids, queue, head, req, echoes, prompts):
        common, index = req.common, {rid: i for i, rid in enumerate(ids)}
        sent = dict.fromkeys(ids, 0)  # generated tokens already streamed, per choice
        started, left, completion = set(), set(ids), 0

        def chunk(i, text, logprobs, finish_reason):
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            return f"data: {json.dumps(dict(head, choices=[choice]))}\n\n"

        try:
            while left:
                out = await queue.get()
                rid, i = out.request_id, index[out.request_id]
                text, logprobs = out.new_text, None
                if common.logprobs is not None:
                    pieces = _pieces(out.text, out.token_offsets, len(out.token_ids))[sent[rid] :]
                    entries = list(out.logprobs or [])[sent[rid] :]
                    if echoes is not None and rid not in started:
                        echo = echoes[i // common.n]
                        pieces = echo[1] + pieces
                        entries = list(out.prompt_logprobs or [None] * len(echo[1])) + entries
                    logprobs = completion_logprobs(entries, token_text, pieces, 0)
                    sent[rid] = len(out.token_ids)
                if echoes is not None and rid not in started:
                    text = echoes[i // common.n][0] + text
                started.add(rid)
                if text or logprobs and logprobs["tokens"]:
                    yield chunk(i, text, logprobs, None)
                if out.finished:
                    left.discard(rid)
                    completion += len(out.token_ids)
                    yield chunk(i, "", None, out.finish_reason)
            if common.include_usage:
                yield f"data: {json.dumps(dict(head, choices=[], usage=usage(sum(map(len, prompts)), completion)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream: free the blocks
            runner.abort([rid for rid in ids if rid in left])

    # -- /v1/chat/completions ------------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_json(request)
        req = parse_chat(body)
        plan = read_tools(body)
        common = req.common
        if plan.active and common.response_format is not None:
            raise bad("response_format", "cannot be combined with tools unless tool_choice is 'none'")
        common.grammar = plan.grammar
        if getattr(tokenizer, "chat_template", None) is None:
            raise bad("messages", "this model's tokenizer has no chat template; use /v1/completions")
        try:
            text = await run_in_threadpool(tokenizer.apply_chat_template, req.messages, tools=plan.tools or None,
                                           tokenize=False, add_generation_prompt=True)  # fmt: skip
        except Exception as error:  # a template that rejects the roles or their order
            raise bad("messages", f"the chat template failed: {str(error)[:200]}") from None
        prompt = await tokenize(text, False, "messages")
        if not prompt:
            raise bad("messages", "the chat template produced no tokens")
        max_tokens = budget(prompt, common.max_tokens, "the chat prompt")
        name = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        ids, queue = await submit([(prompt, common.sampling(max_tokens, j)) for j in range(common.n)], name,
                                  "tools" if plan.active else "response_format")  # fmt: skip
        head = {"id": name, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        if common.stream:
            head["object"] = "chat.completion.chunk"
            return StreamingResponse(stream_chat(ids, queue, head, req, plan, len(prompt)),
                                     media_type="text/event-stream")  # fmt: skip
        finals = await wait_all(request, ids, queue)
        choices = []
        for i, rid in enumerate(ids):
            out = finals[rid]
            content, calls = parse_output(plan, out.text, cut=out.finish_reason == "length")
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            logprobs = None
            if req.top_logprobs is not None:
                logprobs = {"content": chat_logprobs(out.logprobs or [], token_text, req.top_logprobs)}
            reason = _finish_reason(out.finish_reason, calls)
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        completion = sum(len(finals[rid].token_ids) for rid in ids)
        return dict(head, choices=choices, usage=usage(len(prompt), completion))

    async def stream_chat(ids, queue, head, req, plan: ToolPlan, prompt_tokens: int):
        """Content streams as it comes. With tools the answer is held until it is known to be text (tool_choice
        "auto": its first character is not "<") or, for a call, until its end (one tool_calls delta)."""
        index, sent, left, completion = {rid: i for i, rid in enumerate(ids)}, dict.fromkeys(ids, 0), set(ids), 0
        held = dict.fromkeys(ids, "")  # text (new_text of the outputs) not streamed yet
        texting = set(ids) if not plan.active else set()

        def chunk(i, delta, finish_reason=None, logprobs=None):
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return f"data: {json.dumps(dict(head, choices=[choice]))}\n\n"

        def pending_logprobs(rid, out):
            if req.top_logprobs is None:
                return None
            entries, sent[rid] = (out.logprobs or [])[sent[rid] :], len(out.token_ids)
            return {"content": chat_logprobs(entries, token_text, req.top_logprobs)}

        try:
            for i in range(len(ids)):
                yield chunk(i, {"role": "assistant", "content": ""})
            while left:
                out = await queue.get()
                rid, i = out.request_id, index[out.request_id]
                held[rid] += out.new_text
                if plan.mode == "auto" and rid not in texting and held[rid] and not held[rid].startswith("<"):
                    texting.add(rid)  # the grammar's text branch: no call can follow
                if rid in texting:
                    text, held[rid] = held[rid], ""
                    logprobs = pending_logprobs(rid, out)
                    if text or logprobs and logprobs["content"]:
                        yield chunk(i, {"content": text}, logprobs=logprobs)
                if not out.finished:
                    continue
                left.discard(rid)
                completion += len(out.token_ids)
                reason = out.finish_reason
                if rid not in texting:  # held: a tool call, or text that could not be told apart until the end
                    content, calls = parse_output(plan, out.text, cut=reason == "length")
                    logprobs = pending_logprobs(rid, out)
                    reason = _finish_reason(reason, calls)
                    if calls:
                        yield chunk(i, {"tool_calls": [dict(calls[0], index=0)]}, logprobs=logprobs)
                    elif content or logprobs:
                        yield chunk(i, {"content": content}, logprobs=logprobs)
                yield chunk(i, {}, reason)
            if req.common.include_usage:
                yield f"data: {json.dumps(dict(head, choices=[], usage=usage(prompt_tokens, completion)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            runner.abort([rid for rid in ids if rid in left])

    return app


def _finish_reason(engine_reason: str, calls: list[dict] | None) -> str:
    """"tool_calls" for a complete call; a call the length limit cut keeps "length" (one whose JSON Schema check
    failed keeps "check_failed"), so a client never runs it."""
    return "tool_calls" if calls and engine_reason not in ("length", "check_failed") else engine_reason


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _parse_json(raw: bytes):
    """json.loads, refusing text no tokenizer can take: an unpaired UTF-16 surrogate ("\\ud800") is valid JSON."""
    body = json.loads(raw)
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("it contains an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape)") from None
    return body


def _echo(tokenizer, prompt_ids: list[int]) -> tuple[str, list[str]]:
    """A prompt's text (= decode(prompt)) and each token's piece of it ("".join(pieces) == text)."""
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in prompt_ids:
        detok.add(token)
    detok.text += detok.flush()
    return detok.text, _pieces(detok.text, detok.offsets, len(prompt_ids))


def _pieces(text: str, offsets: list[int], count: int) -> list[str]:
    """Token i's text: text[offsets[i]:offsets[i + 1]] (a token whose character a later one completes gets "")."""
    offsets = list(offsets[:count]) + [len(text)] * (count - len(offsets))
    return [text[start:stop] for start, stop in zip(offsets, offsets[1:] + [len(text)])]


def make_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """A uvicorn.Server for `app` whose SIGTERM / Ctrl-C handler starts the drain clock at the signal (uvicorn alone
    waits for every connection to close first, however long its request runs)."""
    import uvicorn

    drain = app.state.drain_timeout

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.runner.begin_drain(drain)
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain + 5))


def serve(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 256,
          drain_timeout: float = 10.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:  # fmt: skip
    """Run the server until SIGTERM / Ctrl-C; then drain for at most `drain_timeout` s, abort the rest, return."""
    make_server(create_app(engine, model_name, max_queue, drain_timeout, max_body_bytes), host, port).run()
