"""OpenAI-compatible HTTP server over the Engine (FastAPI + uvicorn, the `serve` extra).

    hf-attn serve MODEL [--host 127.0.0.1 --port 8000 --max-queue 256 --drain-timeout 10 --max-body-bytes 8388608]

Endpoints: POST /v1/completions (completions.py), POST /v1/chat/completions (chat.py), GET /v1/models,
GET /v1/models/{id}, GET /health. Request fields are validated in protocol.py (tools in tools.py); the HTTP side:
  - one background thread runs engine steps (engine_thread.py); each HTTP request waits on its own asyncio queue;
  - bodies above `max_body_bytes` are refused (413) while being read, before parsing; JSON parsing, tokenization,
    chat templates and the engine's add_request (grammar compilation) run in the threadpool, off the event loop
    (context.py);
  - a prompt longer than the model's context, or prompt + max_tokens beyond it, is a 400 naming both numbers;
  - a non-streaming client that disconnects aborts its requests (polled every 0.25 s), a streaming one too;
  - SIGTERM / Ctrl-C: stop accepting (503), let in-flight requests run for `drain_timeout` seconds, then abort the
    rest (a streamed choice gets a final chunk with finish_reason "abort", a waiting one a 503) and exit.
Errors: {"error": {"message", "type", "param", "code"}}: 400 invalid field (named in `param`), 404 unknown model or
route, 413 body too large, 429 queue full (waiting + running requests >= max_queue), 503 shutting down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import chat, completions
from .context import DEFAULT_MAX_BODY_BYTES, ClientGone, ServingContext
from .protocol import APIError

logger = logging.getLogger(__name__)


def create_app(
    engine,
    model_name: str,
    max_queue: int = 256,
    drain_timeout: float = 10.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
):
    """The FastAPI app. The engine thread starts now; the app's shutdown drains it (see the module docstring)."""
    ctx = ServingContext(engine, model_name, max_queue, drain_timeout, max_body_bytes)
    thread = ctx.thread

    @asynccontextmanager
    async def lifespan(app):
        yield
        thread.begin_drain(drain_timeout)
        while thread.routes and time.monotonic() < thread.drain_deadline + 5:
            await asyncio.sleep(0.02)
        thread.stop()

    app = FastAPI(title="hf-attn-patch", lifespan=lifespan)
    app.state.serving = ctx
    _add_error_handlers(app)
    _add_model_routes(app, ctx)
    app.include_router(completions.router)
    app.include_router(chat.router)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

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
        return JSONResponse(
            APIError(500, f"internal error: {type(error).__name__}", None, "server_error").body(), status_code=500
        )


def _add_model_routes(app: FastAPI, ctx: ServingContext) -> None:
    """GET /health, /v1/models, /v1/models/{id}."""
    engine, model_name = ctx.engine, ctx.model_name

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "local", "max_model_len": ctx.limit}

    def pool_stats() -> dict:
        with engine.lock:  # a consistent view between two engine steps
            return engine.kv_stats()

    @app.get("/health")
    async def health():
        return {
            "status": "ok" if ctx.thread.accepting else "shutting_down",
            "in_flight": ctx.thread.in_flight,
            "kv_cache": await run_in_threadpool(pool_stats),
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(
                404,
                f"model {model_id!r:.100} does not exist; this server has {model_name!r}",
                "model",
                "model_not_found",
            )
        return model_card()


def make_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """A uvicorn.Server for `app` whose SIGTERM / Ctrl-C handler starts the drain clock at the signal (uvicorn alone
    waits for every connection to close first, however long its request runs)."""
    import uvicorn

    ctx: ServingContext = app.state.serving
    drain = ctx.drain_timeout

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            ctx.thread.begin_drain(drain)
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain + 5))


def serve(
    engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_queue: int = 256,
    drain_timeout: float = 10.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> None:
    """Run the server until SIGTERM / Ctrl-C; then drain for at most `drain_timeout` s, abort the rest, return."""
    make_server(create_app(engine, model_name, max_queue, drain_timeout, max_body_bytes), host, port).run()
