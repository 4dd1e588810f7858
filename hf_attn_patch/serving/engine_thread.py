"""The engine thread: one background thread runs engine steps and routes each output to its request's asyncio queue.

Admission counts requests in flight (routed + reserved while being tokenized / added) against `max_queue`; a drain
stops admission and aborts what still runs after its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from .protocol import APIError

logger = logging.getLogger(__name__)


class EngineThread:
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
                raise APIError(
                    429,
                    f"too many requests in flight ({self.in_flight} + {count} > max_queue={self.max_queue})",
                    kind="rate_limit_exceeded",
                )
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


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
