"""Shared by the server tests: run create_app on a free localhost port in a thread; raw HTTP calls."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

from hf_attn_patch.serving import create_app, make_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(engine, name: str = "stories260k", **app_kwargs):
    """Yields (port, uvicorn server); on exit asks it to stop (as SIGTERM would) and joins it."""
    port = free_port()
    server = make_server(create_app(engine, name, **app_kwargs), "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def http(port: int, path: str, body=None, method: str | None = None, timeout: float = 120) -> tuple[int, dict]:
    """(status, JSON body); `body` a dict (sent as JSON) or raw bytes."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def sse(port: int, path: str, body: dict, timeout: float = 120) -> list:
    """A streamed call -> the decoded `data:` payloads (the final "[DONE]" kept as the string)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        for line in reply:
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error_shape(status: int, body: dict) -> None:
    """OpenAI's error shape: {"error": {"message": str, "type": str, "param": str | None, "code": int}}."""
    assert 400 <= status < 500, (status, body)
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and "param" in error and error["code"] == status
