"""OpenAI-compatible HTTP server over the Engine (FastAPI + uvicorn, the `serve` extra).

    hf-attn serve MODEL [--host 127.0.0.1 --port 8000 --max-batch-tokens 512 --max-memory BYTES --max-queue 256]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template; `stream: true` sends
server-sent events ending in `data: [DONE]`; `response_format` constrains the output), GET /v1/models, GET /health.
One background thread runs engine steps; each HTTP request waits on its own asyncio queue. Errors follow OpenAI's
shape {"error": {"message", "type", "param", "code"}}: 400 for invalid fields (named), 404 for an unknown model,
429 when the queue (waiting + running requests) is full, 503 while shutting down. Shutdown stops accepting, lets
in-flight requests finish for `drain_seconds`, then aborts the rest.
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

from .engine import Engine
from .params import SamplingParams

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class EngineRunner:
    """Runs engine steps on a background thread and routes each output to its request's asyncio queue."""

    def __init__(self, engine: Engine, max_queue: int):
        self.engine, self.max_queue = engine, max_queue
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.accepting = True
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="hf-attn-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt, params: SamplingParams) -> tuple[str, asyncio.Queue]:
        if not self.accepting:
            raise APIError(503, "the server is shutting down", kind="service_unavailable")
        if len(self.queues) >= self.max_queue:
            raise APIError(429, f"too many requests in flight ({len(self.queues)} >= max_queue={self.max_queue})",
                           kind="rate_limit_exceeded")  # fmt: skip
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        try:
            request_id = self.engine.add_request(prompt, params)
        except ValueError as error:
            raise APIError(400, str(error)) from error
        self.queues[request_id] = (loop, queue)
        self._wake.set()
        return request_id, queue

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
            try:
                outputs = self.engine.step()
            except Exception:  # a failed step must not hang the clients: fail every waiting request
                logger.exception("engine step failed")
                outputs = []
                for request_id in list(self.queues):
                    self.engine.abort(request_id)
                outputs = self.engine.step()
            for out in outputs:
                target = self.queues.get(out.request_id)
                if target is None:
                    continue
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, out)
                if out.finished:
                    self.queues.pop(out.request_id, None)

    def shutdown(self, drain_seconds: float) -> None:
        self.accepting = False
        deadline = time.monotonic() + drain_seconds
        while self.queues and time.monotonic() < deadline:
            time.sleep(0.02)
        for request_id in list(self.queues):
            self.abort(request_id)
        deadline = time.monotonic() + 5
        while self.queues and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)


def _number(body: dict, name: str, default, low=None, high=None, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise APIError(400, f"{name}={value!r}: expected {'an integer' if integer else 'a number'}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise APIError(400, f"{name}={value!r}: must be in [{low}, {high}]", name)
    return value


def sampling_params(body: dict, max_tokens_field: str = "max_tokens") -> SamplingParams:
    """OpenAI request fields -> SamplingParams, with 400s naming the field."""
    if body.get("n", 1) != 1:
        raise APIError(400, f"n={body.get('n')!r}: only n=1 is supported", "n")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"stop={body.get('stop')!r}: expected a string or a list of non-empty strings", "stop")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or "type" not in response_format):
        raise APIError(400, f"response_format={response_format!r}: expected an object with a 'type'", "response_format")
    if response_format is not None and response_format["type"] == "text":
        response_format = None
    max_tokens = body.get(max_tokens_field, body.get("max_tokens"))
    return SamplingParams(
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", 256, 1, None, integer=True),
        temperature=_number(body, "temperature", 1.0, 0, 2),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1),
        top_k=_number(body, "top_k", 0, 0, None, integer=True),
        seed=_number(body, "seed", None, integer=True),
        stop=stop,
        logprobs=bool(body.get("logprobs")),
        response_format=response_format,
    )


def create_app(engine: Engine, model_name: str, max_queue: int = 256, drain_seconds: float = 10.0):
    """The FastAPI app. The engine thread starts now; the app's shutdown drains it."""
    runner = EngineRunner(engine, max_queue)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, runner.shutdown, drain_seconds)

    app = FastAPI(title="hf-attn-patch", lifespan=lifespan)
    app.state.runner = runner

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    async def parse(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from error
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if body.get("model") not in (None, model_name):
            raise APIError(404, f"model={body.get('model')!r} does not exist; this server has {model_name!r}", "model",
                           "model_not_found")  # fmt: skip
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok" if runner.accepting else "shutting_down", "in_flight": len(runner.queues)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "local"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) for t in prompt)):  # fmt: skip
            raise APIError(400, f"prompt={prompt!r:.80}: expected a non-empty string or a list of token ids", "prompt")
        return await respond(prompt, sampling_params(body), body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str) for m in messages):  # fmt: skip
            raise APIError(400, "messages: expected a non-empty list of {role, content} objects", "messages")
        params = sampling_params(body, "max_completion_tokens")
        try:
            prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # a tokenizer without a template, or a template that rejects the roles
            raise APIError(400, f"messages: the chat template failed: {error}", "messages") from error
        ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
        return await respond(ids, params, body, chat=True)

    async def respond(prompt, params: SamplingParams, body: dict, chat: bool):
        request_id, queue = runner.submit(prompt, params)
        created, name = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.get("stream"):
            return StreamingResponse(stream(request_id, queue, created, name, chat), media_type="text/event-stream")
        while not (out := await queue.get()).finished:
            pass
        usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                 "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}  # fmt: skip
        choice = {"index": 0, "finish_reason": out.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
            choice["logprobs"] = {"token_logprobs": out.logprobs} if out.logprobs is not None else None
        return {"id": name, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [choice], "usage": usage}  # fmt: skip

    async def stream(request_id, queue, created, name, chat):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(delta_text, finish_reason, first=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {"content": delta_text}
                choice = {"index": 0, "delta": delta if finish_reason is None else {}, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": delta_text, "finish_reason": finish_reason, "logprobs": None}
            payload = {"id": name, "object": kind, "created": created, "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield event("", None, first=True)
            while True:
                out = await queue.get()
                if out.new_text:
                    yield event(out.new_text, None)
                if out.finished:
                    yield event("", out.finish_reason)
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream: free its blocks
            if request_id in runner.queues:
                runner.abort(request_id)

    return app


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 256) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, model_name, max_queue), host=host, port=port, log_level="info")
