"""The OpenAI-compatible server, end to end: uvicorn on localhost, the real `openai` client."""

from __future__ import annotations

import socket
import threading
import time

import json
import urllib.error
import urllib.request
import openai
import pytest
import torch
import uvicorn

from hf_attn_patch.engine import Engine
from hf_attn_patch.engine.server import create_app
from hf_attn_patch.models.pretrained import load_default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    model, tok = load_default()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )  # stories260k ships no chat template: a plain one
    engine = Engine(model, tok, block_size=8)
    port = _free_port()
    config = uvicorn.Config(create_app(engine, "stories260k", max_queue=3), host="127.0.0.1", port=port,
                            log_level="warning")  # fmt: skip
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    while not instance.started:
        time.sleep(0.02)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    yield client, model, tok, port
    instance.should_exit = True
    thread.join(timeout=20)


def _http(port: int, path: str, body: bytes | None = None) -> tuple[int, dict]:
    """A raw HTTP call (status, JSON body) for what the openai client cannot send (bad JSON) or does not expose."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _greedy(model, ids, n):
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids) :]


def test_completion_matches_generate(server):
    client, model, tok, _ = server
    prompt = "Once upon a time"
    result = client.completions.create(model="stories260k", prompt=prompt, max_tokens=24, temperature=0)
    expected = tok.decode(_greedy(model, tok(prompt).input_ids, 24), skip_special_tokens=True)
    assert result.choices[0].text == expected
    assert result.usage.completion_tokens > 0 and result.choices[0].finish_reason in ("length", "stop")


def test_chat_streaming_and_models(server):
    client, model, tok, _ = server
    assert [m.id for m in client.models.list()] == ["stories260k"]
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    whole = client.chat.completions.create(model="stories260k", messages=messages, max_tokens=20, temperature=0)
    chunks = client.chat.completions.create(model="stories260k", messages=messages, max_tokens=20, temperature=0,
                                            stream=True)  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content and len(streamed) > 0


def test_clear_errors(server):
    client, _, _, port = server
    with pytest.raises(openai.BadRequestError, match="temperature=5"):
        client.completions.create(model="stories260k", prompt="Hi", temperature=5)
    with pytest.raises(openai.NotFoundError, match="model='gpt-4' does not exist"):
        client.completions.create(model="gpt-4", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="stories260k", messages=[])
    status, body = _http(port, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert _http(port, "/health")[1]["status"] == "ok"


def test_queue_full_is_429(server):
    _, _, _, port = server
    results = []

    def call():
        body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
        results.append(_http(port, "/v1/completions", json.dumps(body).encode())[0])

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 429 in results and 200 in results  # max_queue=3: some wait their turn as errors, none is lost
