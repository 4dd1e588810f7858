"""OpenAI request validation and response shapes, independent of HTTP and of the engine thread.

Every field a client may send is listed here with its type and range; anything else is a 400 naming it
(never silently ignored). Fields we accept only at their no-op value (frequency_penalty=0, logit_bias={}, ...) say
so in the error. Errors are `APIError(status, message, param)` -> {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..engine.params import MAX_LOGPROBS, SamplingParams

MAX_N = 64  # choices per request
MAX_PROMPTS = 256  # prompts in one /v1/completions body
MAX_STOP = 16  # stop strings per request
MAX_SEED = 2**63 - 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- field readers: (body, name) -> value, 400 naming the field for a wrong type or range --------------------------


def read_int(body: dict, name: str, default, low: int, high: int):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected an integer in [{low}, {high}], got {_short(value)}")
    if not low <= value <= high:
        raise APIError(400, f"{name}={value}: out of range [{low}, {high}]", name)
    return value


def read_float(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"expected a number, got {_short(value)}")
    finite = isinstance(value, int) or math.isfinite(value)  # an int is compared exactly (10**400 has no float)
    if not finite or value > high or (value <= low if open_low else value < low):
        raise APIError(400, f"{name}={value!r}: out of range {'(' if open_low else '['}{low}, {high}]", name)
    return float(value)


def read_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"expected true or false, got {_short(value)}")
    return value


def check_fields(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise bad(key, f"unknown or unsupported field (supported: {', '.join(sorted(allowed))})")


def read_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise bad("stop", f"expected a string or a list of at most {MAX_STOP} non-empty strings, got {_short(stop)}")
    return stop


def read_response_format(body: dict) -> dict | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad(
            "response_format", f"expected {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got {_short(rf)}"
        )
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise bad("response_format", f"unknown key {sorted(extra)[0]!r}")
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
            raise bad("response_format", f"json_schema: expected {{'name', 'schema': {{...}}}}, got {_short(js)}")
        extra = set(js) - {"name", "schema", "strict", "description", "property_order"}
        if extra:
            raise bad("response_format", f"json_schema: unknown key {sorted(extra)[0]!r}")
        if "schema" not in js:  # OpenAI: no schema = any JSON object
            rf = {"type": "json_object"}
    return None if rf["type"] == "text" else rf


def read_stream_options(body: dict, stream: bool) -> bool:
    """-> include_usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad("stream_options", "only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", f"expected {{'include_usage': bool}}, got {_short(options)}")
    return read_bool(options, "include_usage", False)


# -- requests ----------------------------------------------------------------------------------------------------

COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "user",
    "response_format",
}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}


@dataclass
class Common:
    """What both endpoints share. `sampling(max_tokens, seed)` builds one choice's SamplingParams."""

    max_tokens: int | None  # None: not sent (the server picks a default that fits the context)
    n: int
    seed: int | None
    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    response_format: dict | None
    logprobs: int | None = None  # top alternatives per generated token; None = off
    prompt_logprobs: int | None = None
    grammar: object = None

    def sampling(self, max_tokens: int, choice: int) -> SamplingParams:
        """Choice i of n gets seed + i: a seed reproduces every choice, and n=1 equals choice 0 of n>1."""
        seed = None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop=list(self.stop),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            response_format=self.response_format,
            grammar=self.grammar,
        )


def read_common(body: dict, max_tokens_names: tuple[str, ...]) -> Common:
    if not isinstance(body.get("model", ""), str):
        raise bad("model", f"expected a string, got {_short(body['model'])}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value is not None:
            read_float(body, name, 0.0, -2.0, 2.0)
            if value != 0:
                raise bad(name, f"{value!r} is not supported (only 0)")
    if body.get("logit_bias") is not None and body["logit_bias"] != {}:
        raise bad("logit_bias", f"{_short(body['logit_bias'])} is not supported (only {{}})")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", f"expected a string, got {_short(body['user'])}")
    max_tokens = None
    for name in max_tokens_names:  # chat: max_completion_tokens wins over the deprecated max_tokens
        if body.get(name) is not None:
            max_tokens = read_int(body, name, None, 0, 2**31 - 1)
            break
    stream = read_bool(body, "stream", False)
    return Common(
        max_tokens=max_tokens,
        n=read_int(body, "n", 1, 1, MAX_N),
        seed=read_int(body, "seed", None, 0, MAX_SEED),
        stream=stream,
        include_usage=read_stream_options(body, stream),
        temperature=read_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=read_float(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=read_int(body, "top_k", 0, 0, 2**31 - 1),
        stop=read_stop(body),
        response_format=read_response_format(body),
    )


@dataclass
class CompletionRequest:
    common: Common
    prompts: list  # each a str or a list of token ids
    echo: bool


def parse_completion(body: dict, vocab_size: int) -> CompletionRequest:
    check_fields(body, COMPLETION_FIELDS)
    common = read_common(body, ("max_tokens",))
    if body.get("suffix") is not None:
        raise bad("suffix", "not supported (insertion needs a fill-in-the-middle model)")
    best_of = read_int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != common.n:
        raise bad("best_of", f"best_of={best_of} with n={common.n}: only best_of == n is supported")
    common.logprobs = read_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = read_bool(body, "echo", False)
    if echo and common.logprobs is not None:
        common.prompt_logprobs = common.logprobs
    if common.max_tokens == 0 and not echo:
        raise bad("max_tokens", "0 is only allowed with echo=true (the prompt's logprobs)")
    return CompletionRequest(common, read_prompts(body.get("prompt"), vocab_size), echo)


def read_prompts(prompt, vocab_size: int) -> list:
    """prompt: a string, a list of strings, a list of token ids, or a list of token-id lists -> list of prompts."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise bad(
            "prompt",
            f"expected a non-empty string, list of strings, list of token ids or list of token-id "
            f"lists, got {_short(prompt)}",
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad("prompt", f"{len(prompts)} prompts; at most {MAX_PROMPTS} per request")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise bad("prompt", f"prompt[{i}] is empty")
        elif not (isinstance(p, list) and p and all(_is_token(t) for t in p)):
            raise bad("prompt", f"prompt[{i}]={_short(p)}: expected a non-empty string or list of token ids")
        elif not all(0 <= t < vocab_size for t in p):
            token = next(t for t in p if not 0 <= t < vocab_size)
            raise bad("prompt", f"prompt[{i}] has token id {token}, outside the vocabulary [0, {vocab_size})")
    return prompts


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ChatRequest:
    common: Common
    messages: list[dict]  # normalised: content a string (or None beside tool_calls)
    top_logprobs: int | None  # None: logprobs off
    tools: list[dict] = field(default_factory=list)
    tool_choice: object = "auto"  # "auto" | "required" | "none" | function name (str in a dict, see tools.py)


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: dict) -> ChatRequest:
    check_fields(body, CHAT_FIELDS)
    common = read_common(body, ("max_completion_tokens", "max_tokens"))
    logprobs = read_bool(body, "logprobs", False)
    top = read_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs", "requires logprobs=true")
    common.logprobs = (top or 0) if logprobs else None
    read_bool(body, "parallel_tool_calls", True)  # we return at most one call: allowed either way
    return ChatRequest(common, read_messages(body.get("messages")), common.logprobs)


def read_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"expected a non-empty list of {{role, content}} objects, got {_short(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad("messages", f"{where}: expected an object, got {_short(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise bad("messages", f"{where}.role={_short(role)}: expected one of {', '.join(ROLES)}")
        allowed = (
            {"role", "content", "name"}
            | ({"tool_calls", "refusal"} if role == "assistant" else set())
            | ({"tool_call_id"} if role == "tool" else set())
        )
        extra = set(m) - allowed
        if extra:
            raise bad("messages", f"{where}: unknown key {sorted(extra)[0]!r} for role {role!r}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad("messages", f"{where}.name: expected a string, got {_short(m['name'])}")
        clean = {"role": role, "content": _content(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls") is not None:
            clean["tool_calls"] = _tool_calls(m["tool_calls"], where)
        elif clean["content"] is None:
            raise bad("messages", f"{where}.content: required for role {role!r}")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad("messages", f"{where}.tool_call_id: expected a string, got {_short(m.get('tool_call_id'))}")
            clean["tool_call_id"] = m["tool_call_id"]
        if m.get("name") is not None:
            clean["name"] = m["name"]
        out.append(clean)
    return out


def _content(content, where: str) -> str | None:
    """A string, null, or a list of text parts [{"type": "text", "text": ...}] (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") == "text"
        and isinstance(p.get("text"), str)
        and set(p) <= {"type", "text"}
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad(
        "messages",
        f"{where}.content: expected a string or a list of text parts (images and audio are not "
        f"supported), got {_short(content)}",
    )


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad("messages", f"{where}.tool_calls: expected a list, got {_short(calls)}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        ok = (
            isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments"), str)
            and call.get("type", "function") == "function"
            and isinstance(call.get("id", ""), str)
        )
        if not ok:
            raise bad(
                "messages",
                f"{where}.tool_calls[{j}]: expected {{id, type: 'function', function: {{name, "
                f"arguments: a JSON string}}}}, got {_short(call)}",
            )
        out.append(
            {
                "id": call.get("id", f"call_{j}"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return out


# -- responses ---------------------------------------------------------------------------------------------------


class TokenText:
    """Token id -> its text as it reads inside a text (SentencePiece's leading space kept): decode([anchor, id])
    minus decode([anchor]), cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}
        self.anchor = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("a"))[-1:] or [0]
        self.base = tokenizer.decode(self.anchor)

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            whole = self.tokenizer.decode(self.anchor + [token_id])
            text = whole[len(self.base) :] if whole.startswith(self.base) else self.tokenizer.decode([token_id])
            self.cache[token_id] = text
        return text


def completion_logprobs(entries, token_text: TokenText, pieces: list[str], start_offset: int) -> dict:
    """Legacy completions logprobs for positions with (TokenLogprob | None) entries and their text pieces.

    tokens[i] = pieces[i] (so "".join(tokens) is the text), text_offset[i] = where it starts in the choice's text,
    top_logprobs[i] = {text: logprob} of the k most likely tokens and the chosen one (None where unscored)."""
    tokens, token_logprobs, top_logprobs, offsets, at = [], [], [], [], start_offset
    for entry, piece in zip(entries, pieces):
        tokens.append(piece)
        offsets.append(at)
        at += len(piece)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {token_text(t): lp for t, lp in entry.top}
        top.setdefault(token_text(entry.token_id), entry.logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(entries, token_text: TokenText, k: int) -> list[dict]:
    """Chat logprobs.content: [{token, logprob, bytes, top_logprobs: [k x {token, logprob, bytes}]}]."""

    def one(token_id, logprob):
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top[:k]]) for e in entries]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
