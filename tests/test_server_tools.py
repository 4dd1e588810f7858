"""Tool calling and structured output through the real `openai` client: chat.completions.parse (a pydantic
response_format) and tools / tool_choice, whose arguments follow each function's JSON Schema (grammar-constrained)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from hf_attn_patch.engine import Engine
from hf_attn_patch.models.pretrained import load_default

from ._server import http, running, sse

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
NOTE = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 10}},
    "required": ["text"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "take_note", "parameters": NOTE}},
]
SCHEMAS = {"get_weather": WEATHER, "take_note": NOTE}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(one_torch_thread):
    model, tok = load_default()
    with running(Engine(model, tok, block_size=8)) as (port, _):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0), port


def _check_calls(choice, names):
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return call


def test_named_and_required_tool_choice(client):
    client, _ = client
    for seed in range(3):
        named = client.chat.completions.create(
            model="stories260k",
            messages=ASK,
            tools=TOOLS,
            max_tokens=60,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        _check_calls(named.choices[0], {"get_weather"})
        required = client.chat.completions.create(
            model="stories260k", messages=ASK, tools=TOOLS, max_tokens=80, tool_choice="required", seed=seed
        )
        _check_calls(required.choices[0], set(SCHEMAS))


def test_auto_and_none(client):
    client, _ = client
    seen = set()
    for seed in range(4):
        auto = client.chat.completions.create(model="stories260k", messages=ASK, tools=TOOLS, max_tokens=60, seed=seed)
        choice = auto.choices[0]
        if choice.message.tool_calls:
            _check_calls(choice, set(SCHEMAS))
            seen.add("call")
        else:  # text: the grammar's other branch (anything not starting with "<")
            assert choice.message.content and not choice.message.content.startswith("<")
            seen.add("text")
    assert seen
    none = client.chat.completions.create(
        model="stories260k", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=10, temperature=0
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


def test_history_with_tool_calls_and_results(client):
    client, _ = client
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(
        model="stories260k", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content


def test_streamed_tool_call(client):
    _, port = client
    body = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "take_note"}},
        "max_tokens": 40,
        "stream": True,
        "seed": 1,
    }
    events = sse(port, "/v1/chat/completions", body)
    deltas = [e["choices"][0] for e in events[:-1]]
    calls = [d["delta"]["tool_calls"] for d in deltas if d["delta"].get("tool_calls")]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "take_note"
    jsonschema.validate(json.loads(calls[0][0]["function"]["arguments"]), NOTE)
    assert deltas[-1]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=20)


def test_parse_with_a_pydantic_model(client):
    client, _ = client
    for seed in range(3):
        result = client.chat.completions.parse(
            model="stories260k",
            response_format=Pet,
            max_tokens=40,
            seed=seed,
            messages=[{"role": "user", "content": "Describe a pet."}],
        )
        pet = result.choices[0].message.parsed
        assert isinstance(pet, Pet) and 0 <= pet.age <= 20


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "foo"},
        {"$ref": "#/nope"},
        {"type": "string", "pattern": "("},
        {"type": "string", "minLength": -1},
        {"enum": []},
        {"not": {}},
        5,
        "x",
    ],
)
def test_unusable_schemas_are_400s(client, schema):
    _, port = client
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    status, body = http(port, "/v1/chat/completions", {"messages": ASK, "tools": tools, "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "tools"
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    status, body = http(port, "/v1/completions", {"prompt": "x", "response_format": response_format})
    assert status == 400 and body["error"]["param"] == "response_format"


def test_streamed_auto_equals_whole(client):
    client, port = client
    for seed in range(3):
        body = {"messages": ASK, "tools": TOOLS, "max_tokens": 30, "seed": seed}
        whole = client.chat.completions.create(model="stories260k", **body).choices[0]
        events = sse(port, "/v1/chat/completions", dict(body, stream=True))
        deltas = [e["choices"][0] for e in events[:-1]]
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
        assert deltas[-1]["finish_reason"] == whole.finish_reason
        if whole.message.tool_calls:
            assert [c["function"]["arguments"] for c in calls] == [whole.message.tool_calls[0].function.arguments]
        else:
            assert content == whole.message.content and not calls
            assert sum(1 for d in deltas if d["delta"].get("content")) > 1  # text streamed, not held to the end


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_cut_by_max_tokens(client, choice):
    """A call cut by max_tokens comes back as a call with the arguments so far and finish_reason "length" (as OpenAI
    and vLLM answer), streamed or not; before the function's name is complete, the text is the content."""
    client, port = client
    body = dict(model="stories260k", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0)
    whole = client.chat.completions.create(max_tokens=80, **body).choices[0]
    (complete,) = whole.message.tool_calls
    cut_calls = 0
    for max_tokens in range(2, 40, 3):
        choice_ = client.chat.completions.create(max_tokens=max_tokens, **body).choices[0]
        if choice_.finish_reason != "length":  # the whole call fit
            continue
        events = sse(port, "/v1/chat/completions", dict(body, max_tokens=max_tokens, stream=True))
        deltas = [e["choices"][0] for e in events[:-1]]
        assert deltas[-1]["finish_reason"] == "length"
        streamed = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
        if choice_.message.tool_calls is None:  # the name itself was cut (tool_choice "required" only)
            assert isinstance(choice, str) and choice_.message.content and not streamed
            continue
        (call,) = choice_.message.tool_calls
        assert choice_.message.content is None and call.function.name == complete.function.name
        assert [c["function"]["arguments"] for c in streamed] == [call.function.arguments]
        if not isinstance(choice, str):  # the raw arguments so far: a prefix of the greedy whole
            assert complete.function.arguments.startswith(call.function.arguments)
        if call.function.arguments != complete.function.arguments:  # else: the limit fell on the call's last token
            with pytest.raises(json.JSONDecodeError):  # half-written, and finish_reason says so
                json.loads(call.function.arguments)
            cut_calls += 1
    assert cut_calls >= 2
