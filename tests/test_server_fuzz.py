"""Property test over the request schema: whatever JSON a client sends (wrong types, NaN / Infinity, huge numbers,
lone surrogates and other unicode, unknown keys, nesting), the server answers < 500, and every error is in OpenAI's
shape with the field in `param`. Cases it found are kept as explicit tests in test_server.py::test_clear_errors."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_attn_patch.engine import Engine
from hf_attn_patch.serving.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from hf_attn_patch.models.pretrained import load_default

from ._server import assert_error_shape, running

BASES = {
    "/v1/completions": ({"prompt": "Once upon a time", "max_tokens": 2}, COMPLETION_FIELDS),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, CHAT_FIELDS),
}
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-3, 600),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 0.5, 2**63, 2**64, -(2**63) - 1, 1e308, -0.0, 10**30]),
)
texts = st.one_of(st.text(max_size=20), st.sampled_from(["\ud800", "\x00", "</s>", "<s>", "🙂" * 5, "a" * 300]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system", "x"]), "content": st.one_of(texts, values)},
        optional={"tool_calls": values, "tool_call_id": values, "name": values},
    ),
    max_size=3,
)


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(sorted(BASES)))
    base, fields = BASES[path]
    body = dict(base)
    keys = draw(st.lists(st.one_of(st.sampled_from(sorted(fields)), texts), max_size=4, unique=True))
    for key in keys:
        body[key] = draw(messages if key == "messages" else values)
    if draw(st.booleans()):  # keep generation short when a mutation made the request valid
        body["max_tokens"] = draw(st.integers(0, 4))
    return path, body


@pytest.fixture(scope="module")
def port(one_torch_thread):
    model, tok = load_default()
    with running(Engine(model, tok, block_size=8), max_queue=64) as (port, _):
        yield port


def _post(port: int, path: str, raw: bytes) -> tuple[int, str, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=raw, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.headers.get("content-type", ""), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("content-type", ""), error.read()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(case=bodies())
def test_no_input_gives_a_5xx(port, case):
    path, body = case
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    status, kind, data = _post(port, path, raw)
    assert status < 500, (status, data[:300], body)
    if status >= 400:
        assert kind.startswith("application/json")
        assert_error_shape(status, json.loads(data))
    elif kind.startswith("application/json"):
        assert json.loads(data)["choices"]
    else:
        assert data.rstrip().endswith(b"data: [DONE]")
