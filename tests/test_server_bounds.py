"""Bounded work: a disconnected non-streaming client aborts its request; SIGTERM drains for drain_timeout, then
aborts with a final chunk (streamed) or a 503 (waiting) and exits; a large body's parsing and tokenization leave
/health answering. The engine is wrapped so that requests run as long as max_tokens says (EOS ignored, each step
slowed by a few ms): the behaviour under test does not depend on when the tiny model happens to stop."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

from hf_attn_patch.engine import Engine
from hf_attn_patch.models.pretrained import load_default

from ._server import http, running, sse


class SlowEngine:
    """The engine with EOS ignored and `delay` seconds per step; records aborted request ids."""

    def __init__(self, engine, delay: float):
        self.engine, self.delay, self.aborted, self.finished, self.added = engine, delay, [], [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, prompt, params, request_id=None):
        params.ignore_eos = True
        request = self.engine.add_request(prompt, params, request_id=request_id)
        self.added.append(request_id)
        return request

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.engine.abort(request_id)

    def step(self):
        time.sleep(self.delay)
        outputs = self.engine.step()
        self.finished += [out for out in outputs if out.finished]
        return outputs


@pytest.fixture(scope="module")
def stories(one_torch_thread):
    return load_default()


def _wait(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_disconnected_client_aborts_its_request(stories):
    engine = SlowEngine(Engine(*stories, block_size=8), delay=0.02)  # 400 tokens: >= 8 s if nobody aborts
    with running(engine) as (port, _):
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400}).encode()
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert _wait(lambda: http(port, "/health")[1]["in_flight"] == 1)
        client.close()
        assert _wait(lambda: http(port, "/health")[1]["in_flight"] == 0, timeout=5)
        assert len(engine.aborted) == 1  # freed by the disconnect, not by reaching max_tokens


def test_sigterm_drains_then_aborts(stories):
    engine = SlowEngine(Engine(*stories, block_size=8), delay=0.02)
    drain = 1.0
    with running(engine, drain_timeout=drain) as (port, server):
        results = {}
        long = {"prompt": "Once upon a time", "max_tokens": 400}
        short = {"prompt": "The dog", "max_tokens": 5}
        threads = [
            threading.Thread(
                target=lambda: results.__setitem__("stream", sse(port, "/v1/completions", dict(long, stream=True)))
            ),
            threading.Thread(target=lambda: results.__setitem__("wait", http(port, "/v1/completions", long))),
        ]
        for t in threads:
            t.start()
        # both in the engine: /health's in_flight alone also reads 2 while the first is being added (its reserved
        # slot and its route), before the second request has arrived
        assert _wait(lambda: len(engine.added) == 2)
        assert _wait(lambda: http(port, "/health")[1]["in_flight"] == 2)
        start = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        status, body = http(port, "/v1/completions", short)  # during the drain: refused, not queued
        assert status == 503 and body["error"]["type"] == "service_unavailable"
        for t in threads:
            t.join(timeout=30)
        elapsed = time.monotonic() - start
        events = results["stream"]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort"
        assert results["wait"][0] == 503 and "drain_timeout" in results["wait"][1]["error"]["message"]
        assert drain <= elapsed < drain + 10  # waited for the drain, then stopped (400 tokens would take >= 8 s)


def test_large_body_does_not_block_health(stories):
    with running(Engine(*stories, block_size=8)) as (port, _):
        big = {"prompt": "Once upon a time there was a cat. " * 60_000}  # ~2 MB of text: ~0.5 s to tokenize
        answer = {}
        thread = threading.Thread(target=lambda: answer.setdefault("big", http(port, "/v1/completions", big)))
        thread.start()
        healthy_before = 0
        while thread.is_alive():
            if http(port, "/health")[0] == 200 and thread.is_alive():
                healthy_before += 1
        thread.join()
        status, body = answer["big"]
        assert status == 400 and body["error"]["param"] == "prompt" and "512" in body["error"]["message"]
        assert healthy_before > 0  # /health answered while the big body was parsed and tokenized


def test_n_choices_compute_their_prompt_once(stories):
    engine = SlowEngine(Engine(*stories, block_size=8), delay=0.0)
    prompt = stories[1]("Once upon a time, there was a little girl named Lily. She loved to play outside.").input_ids
    with running(engine) as (port, _):
        status, body = http(port, "/v1/completions", {"prompt": prompt, "n": 4, "max_tokens": 3, "seed": 1})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    hits = sorted(out.prefix_hit_tokens for out in engine.finished)
    full = len(prompt) // 8 * 8  # the prompt's full blocks
    assert len(prompt) >= 16 and hits == [0, full, full, full]  # the first computes it, three reuse its blocks
