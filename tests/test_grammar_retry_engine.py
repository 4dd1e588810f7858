"""Retry after a failed exact JSON Schema check, on every path through one policy (grammar/retry.py's RowRetry):
the engine rewinds a request in place (grammar state, tokens, text, logprobs, KV blocks), the server answers with
it, speculative generate() hands its rows back for generate()'s retry. Without the retry the same requests end
with check_failed: the cases arise; with it they come back valid and the retry counter shows the rewinds."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import hf_attn_patch.engine.output_processor as output_processor
from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.grammar.retry import MAX_RETRIES, RowRetry

from .conftest import tiny_model
from .test_grammar_schemas import FAMILIES, _is_valid

# families whose checks leave a random model no valid continuation in some rows (the close of the root object under
# if / then / else, a string under a format checked here): without a retry those rows end check_failed
RETRIED = ["if_then_else", "format_checked_here"]
NO_VALID_VALUE = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 5,
                                                         "not": {"type": "integer"}}},
                  "required": ["v"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def random_llama(stories):
    """A random-weight tiny llama over stories260k's 512-token vocabulary: it emits garbage unless constrained."""
    return tiny_model("llama", vocab_size=512, seed=3)


def _fmt(schema):
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def _model_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _run(engine, tok, schema, n=8, **extra):
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, response_format=_fmt(schema), **extra) for s in range(n)
    ]
    return engine.generate([[tok.bos_token_id]] * n, params)


class _Recording(RowRetry):
    """RowRetry that keeps the tokens each rewind discards (what the prefix cache named before the rewind)."""

    seen: list = []

    def plan(self, state, max_new_tokens):
        self.seen.append(list(state.tokens))
        return super().plan(state, max_new_tokens)


@pytest.mark.parametrize("family", RETRIED)
def test_engine_rewinds_and_retries(random_llama, stories, family, monkeypatch, one_torch_thread):
    """Every request that stops validates; rewound requests are counted; with no retries allowed, requests of the
    same seeds end check_failed (the case arises). KV after a rewind: the rewound requests' logprobs are the
    model's own at every position (fp32, a differently packed attention: atol 1e-4), and so are those of requests
    whose prompt is a rewound request's discarded tokens: they hit the blocks named before the rewind, which the
    rewind left intact (copy-on-write)."""
    tok = stories[1]
    schema = FAMILIES[family][0]
    monkeypatch.setattr(output_processor, "RowRetry", lambda: RowRetry(0))
    plain = _run(Engine(random_llama, tok, block_size=4), tok, schema)
    assert sum(o.finish_reason == "check_failed" for o in plain) >= 2, [o.finish_reason for o in plain]
    assert all(o.metrics["grammar_retries"] == 0 for o in plain)
    monkeypatch.setattr(output_processor, "RowRetry", _Recording)
    _Recording.seen = []
    engine = Engine(random_llama, tok, block_size=2)  # rewinds cross block boundaries and named (cached) blocks
    outs = _run(engine, tok, schema, logprobs=0)
    assert sum(o.metrics["grammar_retries"] for o in outs) >= 2
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) > sum(o.finish_reason == "stop" for o in plain)
    for out in outs:
        assert out.finish_reason in ("stop", "check_failed"), out.finish_reason
        if out.finish_reason == "stop":
            assert _is_valid(schema, out.text), (family, out.text)
        else:  # only when its retries are spent
            assert out.metrics["grammar_retries"] == MAX_RETRIES and not _is_valid(schema, out.text)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert len(out.logprobs) == len(out.token_ids)
        ref = _model_logprobs(random_llama, out.prompt_token_ids + out.token_ids)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry.token_id == token and abs(entry.logprob - float(ref[j, token])) < 1e-4, (j, out.request_id)
    discarded = [[tok.bos_token_id] + t for t in _Recording.seen if len(t) >= 4]
    again = engine.generate(discarded, SamplingParams(max_tokens=3, temperature=0, logprobs=0, ignore_eos=True))
    assert sum(out.prefix_hit_tokens > 0 for out in again) >= 2
    for out in again:
        ref = _model_logprobs(random_llama, out.prompt_token_ids + out.token_ids)
        for j, entry in enumerate(out.logprobs):
            pos = len(out.prompt_token_ids) - 1 + j
            assert abs(entry.logprob - float(ref[pos, entry.token_id])) < 1e-4


def test_engine_budget_runs_out_with_check_failed(random_llama, stories, one_torch_thread):
    """A schema whose value can never pass: each request is rewound MAX_RETRIES times, then ends check_failed
    (never "stop" with an invalid answer), its blocks freed."""
    tok = stories[1]
    engine = Engine(random_llama, tok, block_size=4)
    outs = _run(engine, tok, NO_VALID_VALUE, n=3)
    for out in outs:
        assert out.finish_reason == "check_failed", (out.finish_reason, out.text)
        assert out.metrics["grammar_retries"] == MAX_RETRIES
        assert not _is_valid(NO_VALID_VALUE, out.text)
    assert engine.kv_stats()["blocks_used"] == 0


def test_engine_streams_a_checked_request_whole_at_its_end(random_llama, stories, one_torch_thread):
    """A rewind may reach back to the first token, so a checked request's text is not streamed before it ends."""
    tok = stories[1]
    engine = Engine(random_llama, tok, block_size=4)
    engine.add_request(
        [tok.bos_token_id],
        SamplingParams(max_tokens=60, temperature=1.0, seed=1, response_format=_fmt(FAMILIES["if_then_else"][0])),
    )
    outs = list(engine.stream())
    assert all(o.new_text == "" for o in outs[:-1]) and outs[-1].finished and outs[-1].new_text == outs[-1].text


def test_server_response_format_retries(random_llama, stories):
    """The OpenAI server (response_format json_schema) answers with the engine's retried requests: valid JSON."""
    from ._server import http, running, sse

    tok = stories[1]
    schema = FAMILIES["format_checked_here"][0]
    request = {
        "prompt": [tok.bos_token_id],
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 1,
        "response_format": _fmt(schema),
    }
    with running(Engine(random_llama, tok, block_size=8)) as (port, _):
        status, body = http(port, "/v1/completions", {**request, "n": 6})
        events = sse(port, "/v1/completions", {**request, "stream": True})
    assert status == 200, body
    streamed = "".join(e["choices"][0]["text"] for e in events if e != "[DONE]")
    assert streamed == body["choices"][0]["text"]  # the same seed; streamed whole at its end
    reasons = [c["finish_reason"] for c in body["choices"]]
    assert reasons.count("stop") >= 5, reasons
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "check_failed")
        if choice["finish_reason"] == "stop":
            assert _is_valid(schema, choice["text"]), choice["text"]


@pytest.mark.parametrize(
    "drafter", [dict(prompt_lookup_num_tokens=3), dict(assistant_early_exit=1)], ids=["prompt-lookup", "early-exit"]
)
def test_speculative_generate_retries(random_llama, stories, drafter, caplog, one_torch_thread):
    """Speculative generate(response_format=...): drafts go through the same checked matcher, and rows whose check
    failed are rolled back and decoded again by generate()'s retry (its log shows it). Every row that ended
    validates, or its retries are spent (logged MAX_RETRIES times for that row)."""
    tok = stories[1]
    schema = FAMILIES["if_then_else"][0]
    prompt = torch.tensor([[tok.bos_token_id]] * 6)
    valid = rows = 0
    retries = []
    for seed in range(11, 15):  # until some row was retried
        torch.manual_seed(seed)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_attn_patch.grammar.retry"):
            out = random_llama.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=60,
                do_sample=True,
                response_format=_fmt(schema),
                tokenizer=tok,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
                **drafter,
            )
        logged = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
        retries += logged
        for r, row in enumerate(out):
            ids = row[1:].tolist()
            assert tok.eos_token_id in ids
            rows += 1
            if _is_valid(schema, tok.decode(ids[: ids.index(tok.eos_token_id)])):
                valid += 1
            else:
                assert sum(m.startswith(f"grammar row {r}:") for m in logged) == MAX_RETRIES, (r, logged)
        if retries:
            break
    assert retries, "no row was retried"
    assert valid >= rows - 2, (valid, rows)


# --------------------------------------------------------------------------------- tool_choice "auto" (tagged_json)
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_tool_calls_are_widened_and_checked(stories, family, backend):
    """tool_choice "auto" compiles the tools' schemas like response_format (widened + checked, no refusal), with
    either backend: every valid call replays to EOS, every invalid one is stopped before its end, and free text
    stays free."""
    from hf_attn_patch.serving.tools import read_tools
    from hf_attn_patch.grammar import GrammarSpec, compile_grammar

    from .test_grammar_schemas import _replay

    tok = stories[1]
    schema, valid, invalid = FAMILIES[family]
    wrap = (lambda v: v) if schema.get("type") == "object" else (lambda v: {"v": v})
    params = (
        schema
        if schema.get("type") == "object"
        else {"type": "object", "properties": {"v": schema}, "required": ["v"], "additionalProperties": False}
    )
    plan = read_tools(
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}], "tool_choice": "auto"}
    )
    grammar = compile_grammar(
        GrammarSpec.tagged_json(plan.grammar["schema"], plan.grammar["open"], plan.grammar["close"]),
        tok,
        backend=backend,
    )
    assert grammar.backend_name == backend
    assert grammar.checks is not None or backend == "xgrammar" and family == "format_checked_here"  # it knows it

    def call(value):
        return "<tool_call>" + json.dumps({"name": "f", "arguments": wrap(value)}) + "</tool_call>"

    assert all(_replay(grammar, call(v)) for v in valid), family
    assert not any(_replay(grammar, call(v)) for v in invalid), family
    assert _replay(grammar, "Hello <b>there</b>") and not _replay(grammar, "<tool_call>{}")


def test_server_auto_tool_call_with_a_checked_schema(random_llama, stories):
    """The server with tool_choice "auto" and a tool whose parameters use `not` / if-then-else: no 400 (it used to
    be refused), and an answer that is a call has arguments that validate; in the engine, with "<" favoured so the
    random model starts calls, the calls that end validate."""
    from ._server import http, running

    tok = stories[1]
    params = FAMILIES["if_then_else"][0]
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    grammar = {
        "type": "tagged_json",
        "schema": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": "f"}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            ]
        },
        "open": "<tool_call>",
        "close": "</tool_call>",
    }  # what "auto" compiles
    engine = Engine(random_llama, tok, block_size=4)
    lt = tok.convert_tokens_to_ids("<0x3C>")  # "<": raised so that the random model starts calls

    def favour_calls(module, args, logits):
        logits[..., lt] += 12.0
        return logits

    hook = random_llama.lm_head.register_forward_hook(favour_calls)
    try:
        outs = engine.generate(
            [[tok.bos_token_id]] * 8,
            [SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=grammar) for s in range(8)],
        )
    finally:
        hook.remove()
    calls = 0
    for out in outs:
        if out.text.startswith("<tool_call>") and out.finish_reason == "stop":
            body = json.loads(out.text[len("<tool_call>") : -len("</tool_call>")])
            assert _is_valid(params, json.dumps(body["arguments"])), out.text
            calls += 1
    assert calls >= 2, [(o.finish_reason, o.text[:60]) for o in outs]
    with running(Engine(random_llama, tok, block_size=8)) as (port, _):
        status, body = http(
            port,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "tools": tools, "max_tokens": 40, "seed": 1},
        )
    assert status == 200, body
    choice = body["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        assert _is_valid(params, choice["message"]["tool_calls"][0]["function"]["arguments"])


def test_engine_rewinds_a_hybrid_model_by_recomputing(stories, one_torch_thread):
    """A model with constant-state layers (LFM2's short convolutions) cannot cut its state back: a rewound request
    is released and recomputed from its start. Its logprobs are still the model's own (atol 1e-4, as above)."""
    from .test_engine_hybrid import hybrid_model

    tok = stories[1]
    model = hybrid_model("lfm2", vocab_size=512, initializer_range=0.02)
    schema = FAMILIES["format_checked_here"][0]
    engine = Engine(model, tok, block_size=4)
    outs = _run(engine, tok, schema, logprobs=0)
    assert sum(o.metrics["grammar_retries"] for o in outs) >= 1
    for out in outs:
        assert out.finish_reason in ("stop", "check_failed", "length")
        if out.finish_reason == "stop":
            assert _is_valid(schema, out.text), out.text
        ref = _model_logprobs(model, out.prompt_token_ids + out.token_ids)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(entry.logprob - float(ref[j, token])) < 1e-4, (j, out.request_id)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculative_generate_every_family(random_llama, stories, family, caplog, one_torch_thread):
    """Speculative generate() (prompt lookup) per keyword family: a row that ends either validates or was retried
    until its budget ran out (MAX_RETRIES retries logged for it)."""
    tok = stories[1]
    schema = FAMILIES[family][0]
    prompt = torch.tensor([[tok.bos_token_id]] * 4)
    torch.manual_seed(3)
    with caplog.at_level(logging.INFO, logger="hf_attn_patch.grammar.retry"):
        out = random_llama.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=60,
            do_sample=True,
            response_format=_fmt(schema),
            tokenizer=tok,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
            prompt_lookup_num_tokens=3,
        )
    logged = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    for r, row in enumerate(out):
        ids = row[1:].tolist()
        if tok.eos_token_id in ids and not _is_valid(schema, tok.decode(ids[: ids.index(tok.eos_token_id)])):
            assert sum(m.startswith(f"grammar row {r}:") for m in logged) == MAX_RETRIES, (family, r, logged)


def test_engine_rewinds_a_sliding_window_model(stories, one_torch_thread):
    """Mistral with a window of 4 and blocks of 2: blocks slide out of the window as a request grows, so a rewind
    behind them recomputes the request; a short one just cuts. Logprobs are the model's own (atol 1e-4)."""
    tok = stories[1]
    model = tiny_model("mistral", vocab_size=512, sliding_window=4, seed=3)
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 6},
            "b": {"type": "string", "format": "json-pointer", "maxLength": 4},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }  # b's value is rewound, well past the window
    engine = Engine(model, tok, block_size=2)
    outs = _run(engine, tok, schema, logprobs=0)
    assert sum(o.metrics["grammar_retries"] for o in outs) >= 1
    for out in outs:
        if out.finish_reason == "stop":
            assert _is_valid(schema, out.text), out.text
        ref = _model_logprobs(model, out.prompt_token_ids + out.token_ids)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(entry.logprob - float(ref[j, token])) < 1e-4, (j, out.request_id)
