"""The OpenAI-compatible server, end to end: uvicorn on localhost, the real `openai` client and raw HTTP.

References: transformers' own generate() and forward on the same weights (stories260k, which ships a chat template).
"""

from __future__ import annotations

import http.client
import json
import math
import threading

import openai
import pytest
import torch

from hf_attn_patch.engine import Engine
from hf_attn_patch.models.pretrained import load_default

from ._server import assert_error_shape, running, sse
from ._server import http as call

# Engine vs transformers logprobs, fp32: eps 1.2e-7 x log-softmax over 512 logits x 5 layers of 64-wide sums, with
# a safety factor of ~30 for the packed attention's different summation order -> 1e-4.
LOGPROB_ATOL = 1e-4
NAMED = "Once upon a time, there was a little girl named"  # the next word is " Lily": a leading space to keep


@pytest.fixture(scope="module")
def server(one_torch_thread):
    model, tok = load_default()
    engine = Engine(model, tok, block_size=8)
    with running(engine, max_queue=4, max_body_bytes=1 << 20) as (port, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        yield client, model, tok, port


def _greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def _exact(tok, prompt_ids, generated):
    """decode(prompt + completion) minus decode(prompt): the text a completion must return."""
    whole, prompt = tok.decode(prompt_ids + generated, skip_special_tokens=True), tok.decode(prompt_ids)
    assert whole.startswith(prompt)
    return whole[len(prompt) :]


def _logprobs(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]


def test_completion_text_is_exact_streamed_and_not(server):
    client, model, tok, port = server
    ids = tok(NAMED).input_ids
    generated = _greedy(model, ids, 12)
    expected = _exact(tok, ids, generated)
    assert expected.startswith(" ")  # the case that used to lose its space
    whole = client.completions.create(model="stories260k", prompt=NAMED, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    events = sse(port, "/v1/completions", {"prompt": NAMED, "max_tokens": 12, "temperature": 0, "stream": True})
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")


def test_chat_with_the_shipped_template(server):
    client, _, tok, _ = server
    assert tok.chat_template  # the embedded model serves chat without a template from the caller
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    whole = client.chat.completions.create(model="stories260k", messages=messages, max_tokens=20, temperature=0)
    chunks = client.chat.completions.create(
        model="stories260k",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_logprobs_and_echo_match_transformers(server):
    client, model, tok, _ = server
    ids = tok(NAMED).input_ids
    for max_tokens in (0, 1, 3):
        result = client.completions.create(
            model="stories260k", prompt=NAMED, max_tokens=max_tokens, temperature=0, echo=True, logprobs=2
        )
        choice = result.choices[0]
        lp = choice.logprobs
        generated = _greedy(model, ids, max_tokens) if max_tokens else []
        reference = _logprobs(model, ids + generated)
        assert len(lp.tokens) == len(ids) + len(generated)
        assert "".join(lp.tokens) == choice.text == tok.decode(ids) + _exact(tok, ids, generated)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        everything = ids + generated
        for i in range(1, len(everything)):
            expected = float(reference[i - 1, everything[i]])
            assert abs(lp.token_logprobs[i] - expected) < LOGPROB_ATOL
            top = lp.top_logprobs[i]
            assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(float(reference[i - 1].max()), abs=1e-4)
            assert lp.token_logprobs[i] in top.values()  # the chosen token is listed beside the top 2
        assert result.usage.prompt_tokens == len(ids) and result.usage.completion_tokens == len(generated)


def test_prompt_forms_and_n(server):
    client, model, tok, _ = server
    a, b = "Once upon a time", "The dog ran"
    ids_a, ids_b = tok(a).input_ids, tok(b).input_ids
    one = {
        p: client.completions.create(model="stories260k", prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in (a, b)
    }
    for prompt in ([a, b], [ids_a, ids_b]):
        result = client.completions.create(model="stories260k", prompt=prompt, max_tokens=6, temperature=0)
        assert [c.index for c in result.choices] == [0, 1]
        assert [c.text for c in result.choices] == [one[a], one[b]]
        assert result.usage.prompt_tokens == len(ids_a) + len(ids_b)
    assert (
        client.completions.create(model="stories260k", prompt=ids_a, max_tokens=6, temperature=0).choices[0].text
        == one[a]
    )
    # n > 1: seed s gives choice i the seed s + i, so a seed reproduces every choice and n=1 is choice 0 of n=3
    args = dict(model="stories260k", prompt=a, max_tokens=12, temperature=1.0, seed=7)
    three = [c.text for c in client.completions.create(n=3, **args).choices]
    assert three == [c.text for c in client.completions.create(n=3, **args).choices]
    assert client.completions.create(n=1, **args).choices[0].text == three[0]
    assert len(set(three)) > 1
    two = client.completions.create(model="stories260k", prompt=[a, b], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and two.choices[0].text == two.choices[1].text


def test_streamed_n_and_usage(server):
    _, _, tok, port = server
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 1,
    }
    events = sse(port, "/v1/completions", body)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
            if c["logprobs"]:
                tokens[c["index"]] += c["logprobs"]["tokens"]
    plain = call(port, "/v1/completions", dict(body, stream=False, stream_options=None))[1]
    assert [texts[0], texts[1]] == [c["text"] for c in plain["choices"]]
    assert "".join(tokens[0]) == texts[0] and tokens[0] == plain["choices"][0]["logprobs"]["tokens"]
    assert events[-2]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    for max_tokens in (0, 3):  # echo streamed: the prompt's text and logprobs come first
        body = {"prompt": NAMED, "max_tokens": max_tokens, "temperature": 0, "echo": True, "logprobs": 1}
        plain = call(port, "/v1/completions", body)[1]["choices"][0]
        events = sse(port, "/v1/completions", dict(body, stream=True))
        choices = [e["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in choices) == plain["text"]
        streamed = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        assert streamed == plain["logprobs"]["token_logprobs"]


def test_chat_logprobs(server):
    client, model, tok, _ = server
    messages = [{"role": "user", "content": "Hi"}]
    result = client.chat.completions.create(
        model="stories260k", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    prompt = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    ).input_ids
    generated = _greedy(model, prompt, len(content))
    reference = _logprobs(model, prompt + generated)
    for i, entry in enumerate(content):
        assert abs(entry.logprob - float(reference[len(prompt) - 1 + i, generated[i]])) < LOGPROB_ATOL
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model="stories260k", messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_models_and_unknown_routes(server):
    client, _, _, port = server
    assert [m.id for m in client.models.list()] == ["stories260k"]
    assert client.models.retrieve("stories260k").id == "stories260k"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    status, body = call(port, "/v1/models/gpt-4")
    assert_error_shape(status, body)
    assert status == 404 and body["error"]["param"] == "model"
    status, body = call(port, "/v1/nothing-here")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_clear_errors(server):
    client, _, _, port = server
    with pytest.raises(openai.BadRequestError, match="temperature=5"):
        client.completions.create(model="stories260k", prompt="Hi", temperature=5)
    with pytest.raises(openai.NotFoundError, match="model='gpt-4' does not exist"):
        client.completions.create(model="gpt-4", prompt="Hi")
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="stories260k", messages=[])
    cases = [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"prompt": "Hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "Hi", "top_p": Infinity}', "top_p"),
        (b'{"prompt": "Hi", "max_tokens": 1e400}', "max_tokens"),
        (b'{"prompt": "Hi", "seed": ' + b"9" * 40 + b"}", "seed"),
        (b'{"prompt": "Hi", "frobnicate": 1}', "frobnicate"),
        (b'{"prompt": "Hi", "frequency_penalty": 0.5}', "frequency_penalty"),
        (b'{"prompt": [1, 99999]}', "prompt"),
        (b'{"prompt": "Hi", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "Hi", "logprobs": 21}', "logprobs"),
        (b'{"prompt": "Hi", "stream_options": {"include_usage": true}}', "stream_options"),
        (b'{"prompt": "Hi", "n": true}', "n"),
        (b'{"prompt": "Hi", "suffix": "x"}', "suffix"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
        (b'{"prompt": "Hi", "stop": [""]}', "stop"),
        (b'{"prompt": "Hi", "\\ud800": null}', None),  # found by test_server_fuzz: a lone surrogate (was a 500)
        (b'{"prompt": "\\udfff"}', None),
        (b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}", None),
    ]
    for raw, param in cases:
        status, body = call(port, "/v1/completions", raw)
        assert_error_shape(status, body)
        assert body["error"]["param"] == param, (raw[:60], body)
    chat_cases = [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
    ]
    for body, param in chat_cases:
        status, reply = call(port, "/v1/chat/completions", body)
        assert_error_shape(status, reply)
        assert reply["error"]["param"] == param, (body, reply)
    assert call(port, "/health")[1]["status"] == "ok"


def test_context_and_body_limits(server):
    _, _, tok, port = server
    long_ids = [tok("cat").input_ids[-1]] * 600
    status, body = call(port, "/v1/completions", {"prompt": long_ids, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt" and "600" in body["error"]["message"]
    assert "512" in body["error"]["message"]
    status, body = call(port, "/v1/completions", {"prompt": long_ids[:500], "max_tokens": 20})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert all(str(n) in body["error"]["message"] for n in (500, 20, 520, 512))
    # 2 MiB announced > max_body_bytes=1 MiB: refused from the headers alone, before a byte of the body is sent
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(2 << 20))
    connection.endheaders()
    reply = connection.getresponse()
    assert reply.status == 413 and "max_body_bytes" in json.loads(reply.read())["error"]["message"]
    connection.close()


def test_queue_full_is_429(server):
    _, _, _, port = server
    results = []

    def post():
        body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
        results.append(call(port, "/v1/completions", body)[0])

    threads = [threading.Thread(target=post) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 429 in results and 200 in results  # max_queue=4: some are refused at once, none is lost
    status, body = call(port, "/v1/completions", {"prompt": "Hi", "n": 5})  # 5 choices never fit in 4 slots
    assert status == 429 and body["error"]["type"] == "rate_limit_exceeded"
    assert math.isfinite(call(port, "/health")[1]["in_flight"])
