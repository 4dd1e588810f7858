"""JSON Schema keywords the grammar backend refuses: widened grammar + exact jsonschema checks, on every path
(replay through the matcher, generate() processors, speculative decoding, the engine), per keyword family."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from hf_attn_patch.grammar import GrammarError, GrammarSpec, JSONSchemaLogitsProcessor, compile_grammar
from hf_attn_patch.grammar import bitmask as bm
from hf_attn_patch.grammar.formats import format_checker

from .conftest import tiny_model

# family -> (schema, valid instances, invalid instances); small bounds so a random model can finish
FAMILIES = {
    "not": (
        {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"enum": [0, 1, 2, 3, 4, 5, 6]}}
            },
            "required": ["x"],
            "additionalProperties": False,
        },
        [{"x": 7}, {"x": 9}],
        [{"x": 3}, {"x": 0}],
    ),
    "if_then_else": (
        {
            "type": "object",
            "properties": {
                "kind": {"enum": ["n", "s"]},
                "v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 3}]},
            },
            "required": ["kind", "v"],
            "additionalProperties": False,
            "if": {"properties": {"kind": {"const": "n"}}},
            "then": {"properties": {"v": {"type": "integer"}}},
            "else": {"properties": {"v": {"type": "string"}}},
        },
        [{"kind": "n", "v": 5}, {"kind": "s", "v": "ab"}],
        [{"kind": "n", "v": "ab"}, {"kind": "s", "v": 5}],
    ),
    "dependentSchemas": (
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "additionalProperties": False,
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        [{"a": 1, "b": 2}, {"b": 3}, {}],
        [{"a": 1}],
    ),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
            "additionalProperties": False,
            "dependentRequired": {"a": ["b"]},
        },
        [{"a": True, "b": False}, {"b": True}],
        [{"a": True}],
    ),
    "uniqueItems": (
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 3},
            "minItems": 2,
            "maxItems": 4,
            "uniqueItems": True,
        },
        [[0, 1], [3, 2, 1]],
        [[1, 1], [0, 1, 0]],
    ),
    "oneOf": (
        {
            "oneOf": [
                {"type": "integer", "minimum": 0, "maximum": 20},
                {"type": "integer", "minimum": 10, "maximum": 30},
            ]
        },
        [5, 25],
        [15, 10],
    ),
    "contains": (
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 5,
            "contains": {"const": 7},
            "minContains": 1,
            "maxContains": 2,
        },
        [[7], [1, 7, 7]],
        [[1, 2], [7, 7, 7], []],
    ),
    "multipleOf_float": (
        {
            "type": "object",
            "properties": {"p": {"type": "number", "minimum": 0, "maximum": 2, "multipleOf": 0.25}},
            "required": ["p"],
            "additionalProperties": False,
        },
        [{"p": 0.5}, {"p": 1.75}],
        [{"p": 0.3}, {"p": 1.1}],
    ),
    "unknown_format": (
        {
            "type": "object",
            "properties": {"c": {"type": "string", "format": "country-code", "maxLength": 4}},
            "required": ["c"],
            "additionalProperties": False,
        },
        [{"c": "xyz"}, {"c": ""}],
        [{"c": "toolong"}],
    ),
    "format_checked_here": (
        {"type": "array", "items": {"type": "string", "format": "json-pointer", "maxLength": 5}, "maxItems": 2},
        [["/a/b"], ["", "/~1"]],
        [["a/b"], ["/~2"]],
    ),
}


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=format_checker())


def _is_valid(schema, text: str) -> bool:
    try:
        return _validator(schema).is_valid(json.loads(text))
    except ValueError:
        return False


def _replay(grammar, text: str) -> bool:
    """Every token of `text` allowed by the mask in turn, and EOS allowed at the end."""
    adapter = grammar.adapter
    state = grammar.new_state()
    mask = bm.allocate_bitmask(1, adapter.vocab_size)
    for t in adapter.llguidance_tokenizer().tokenize_str(text):
        state.fill_bitmask(mask, 0)
        if not bm.unpack(mask, adapter.vocab_size)[0, t] or not state.accept_token(t):
            return False
    state.fill_bitmask(mask, 0)
    return bool(bm.unpack(mask, adapter.vocab_size)[0, adapter.eos_token_ids[0]])


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # sampled rows: one float path


@pytest.fixture(scope="module")
def random_llama(stories):
    """A random-weight tiny llama over stories260k's 512-token vocabulary: it emits garbage unless constrained."""
    return tiny_model("llama", vocab_size=512, seed=3)


# ------------------------------------------------------------------------------------------------ the matcher
@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_valid_allowed_invalid_caught(stories, family):
    schema, valid, invalid = FAMILIES[family]
    for v in valid:
        assert _validator(schema).is_valid(v), v
    for v in invalid:
        assert not _validator(schema).is_valid(v), v
    grammar = compile_grammar(GrammarSpec.json_schema(schema), stories[1])
    assert grammar.checks is not None and grammar.widened, family
    for v in valid:
        assert _replay(grammar, json.dumps(v)), (family, v)
    for v in invalid:
        assert not _replay(grammar, json.dumps(v)), (family, v)


# keywords xgrammar 0.2.9 compiles but does not enforce, or narrows (schema_relax.py): (schema, valid, invalid)
XGRAMMAR_WIDENED = {
    "pattern_with_length": ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, ["ab"], ["abcd", "A"]),
    "allOf": ({"allOf": [{"type": "integer", "maximum": 50}, {"minimum": 40}]}, [45], [30, 60]),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
        [{"x1": 1}],
        [{"y": 1}, {"x": "s"}],
    ),
    "enum_of_objects": ({"enum": [{"a": 1}, [1, 2], "s"]}, [{"a": 1}, [1, 2], "s"], [{"a": 2}]),
    "format_regex": ({"type": "string", "format": "regex", "maxLength": 9}, ["a+"], ["("]),
}


@pytest.mark.parametrize("family", list(FAMILIES) + list(XGRAMMAR_WIDENED))
def test_xgrammar_backend_widens_and_checks(stories, family):
    """The xgrammar backend goes through the same widening + exact checks: valid instances replay to EOS, invalid
    ones are caught, for every keyword family and for what xgrammar itself does not enforce."""
    schema, valid, invalid = {**FAMILIES, **XGRAMMAR_WIDENED}[family]
    grammar = compile_grammar(GrammarSpec.json_schema(schema), stories[1], backend="xgrammar")
    assert grammar.backend_name == "xgrammar"
    for v in valid:
        assert _replay(grammar, json.dumps(v)), (family, v)
    for v in invalid:
        assert not _replay(grammar, json.dumps(v)), (family, v)


@pytest.mark.parametrize("family", ["not", "uniqueItems", "oneOf", "dependentRequired"])
def test_xgrammar_generate_retries_and_validates(random_llama, stories, family):
    """generate(response_format=..., grammar_backend="xgrammar") with a random model: rows that end validate
    (rows whose retries ran out excepted, as with llguidance: rare here)."""
    schema = FAMILIES[family][0]
    tok = stories[1]
    torch.manual_seed(5)
    prompt = torch.tensor([[tok.bos_token_id]] * 4)
    out = random_llama.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=60,
        do_sample=True,
        response_format={"type": "json_schema", "json_schema": {"schema": schema}},
        tokenizer=tok,
        grammar_backend="xgrammar",
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    ended = [row[1:].tolist() for row in out if tok.eos_token_id in row[1:].tolist()]
    valid = [_is_valid(schema, tok.decode(ids[: ids.index(tok.eos_token_id)])) for ids in ended]
    assert len(ended) >= 3 and sum(valid) >= len(ended) - 1, (family, valid)


def test_enum_items_under_unique_items_do_not_get_stuck(random_llama, stories):
    """An item of a uniqueItems array of enum strings is masked where it starts to repeat one ("appl" once "apple"
    is in), and a new item once every string is in, rather than at its closing quote when no other completion is
    left: with the processor alone (no retry), every row ends with EOS and validates."""
    tok = stories[1]
    schema = {"type": "array", "items": {"enum": ["apple", "apricot", "banana"]}, "minItems": 3, "uniqueItems": True}
    grammar = compile_grammar(GrammarSpec.json_schema(schema), tok)
    for v in (["apple", "banana", "apricot"], ["apricot", "apple", "banana"]):
        assert _replay(grammar, json.dumps(v)), v
    for v in (["apple", "apple", "banana"], ["apple", "banana", "apricot", "apple"], ["apple", "banana"]):
        assert not _replay(grammar, json.dumps(v)), v
    proc = JSONSchemaLogitsProcessor(schema, tok)
    rows = _generate(random_llama, tok, proc, 8, 60, seed=0)
    assert all(ended and _is_valid(schema, text) for text, ended in rows), (rows, proc.finish_reasons)


def test_failing_close_is_masked_not_the_value(stories):
    """The token closing a governed value with an invalid value is masked; the value may go on (x: 3 -> 3x)."""
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer", "not": {"const": 3}}},
        "required": ["x"],
        "additionalProperties": False,
    }
    grammar = compile_grammar(GrammarSpec.json_schema(schema), stories[1])
    state = grammar.new_state()
    lt = grammar.adapter.llguidance_tokenizer()
    assert state.accept_tokens(lt.tokenize_str('{"x": 3')) == len(lt.tokenize_str('{"x": 3'))
    allowed = state.allowed_mask()
    close = lt.tokenize_str("}")[0]
    assert not allowed[close] and allowed[lt.tokenize_str("4")[0]]
    assert state.validate_tokens([close]) == 0  # drafts are checked the same way
    assert state.accept_tokens(lt.tokenize_str("4}")) == len(lt.tokenize_str("4}")) and state.is_accepting()


def test_unknown_format_is_reported_and_accepts_any_string(stories):
    schema = FAMILIES["unknown_format"][0]
    grammar = compile_grammar(GrammarSpec.json_schema(schema), stories[1])
    assert any("country-code" in n and "#/properties/c" in n for n in grammar.notes)
    proc = JSONSchemaLogitsProcessor(schema, stories[1])
    assert proc.grammars[0].notes == grammar.notes
    assert _replay(grammar, json.dumps({"c": "?!"}))


def test_remaining_refusal_names_keyword_and_path(stories):
    with pytest.raises(GrammarError, match=r"'\$ref' at #/properties/p/items"):
        JSONSchemaLogitsProcessor(
            {"type": "object", "properties": {"p": {"type": "array", "items": {"$ref": "#/definitions/absent"}}}},
            stories[1],
        )


def test_schema_needing_no_checks_keeps_the_plain_path(stories):
    grammar = compile_grammar(
        GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "schema"), stories[1]
    )
    assert grammar.checks is None and not grammar.widened
    assert type(grammar.new_state()._m).__name__ == "_LLGMatcher"


# --------------------------------------------------------------------------------------------- generate() path
def _generate(model, tok, processor, n: int, max_new_tokens: int, seed: int):
    torch.manual_seed(seed)
    prompt = torch.tensor([[tok.bos_token_id]] * n)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=True,
        logits_processor=[processor],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    rows = []
    for r in range(n):
        ids = out[r, 1:].tolist()
        ended = tok.eos_token_id in ids
        rows.append((tok.decode(ids[: ids.index(tok.eos_token_id)] if ended else ids), ended))
    return rows


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_outputs_validate(random_llama, stories, family):
    """Sampled rows of a random model: a row that ends with EOS validates, or its finish reason is check_failed
    (a value the grammar let open and no valid continuation is left: generate() cannot take tokens back)."""
    schema = FAMILIES[family][0]
    tok = stories[1]
    proc = JSONSchemaLogitsProcessor(schema, tok)
    rows = _generate(random_llama, tok, proc, 6, 60, seed=11)
    valid = 0
    for (text, ended), reason in zip(rows, proc.finish_reasons):
        if ended and (reason or "").startswith("check_failed"):
            assert not _is_valid(schema, text)
        elif ended:
            assert _is_valid(schema, text), (family, text, reason)
            valid += 1
    assert valid >= 2, (family, rows, proc.finish_reasons)


def test_budget_runs_out_with_a_distinct_finish_reason(random_llama, stories):
    """No valid completion: the row ends (EOS forced) with finish reason check_failed naming the keyword."""
    tok = stories[1]
    schema = {
        "type": "object",
        "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 5, "not": {"type": "integer"}}},
        "required": ["v"],
        "additionalProperties": False,
    }
    proc = JSONSchemaLogitsProcessor(schema, tok)
    rows = _generate(random_llama, tok, proc, 2, 30, seed=0)
    for (text, ended), reason in zip(rows, proc.finish_reasons):
        assert ended and not _is_valid(schema, text)
        assert reason.startswith("check_failed: 'not' at #/properties/v"), reason
    # a livelock (the array may grow forever, its close always fails) ends when the attempts run out
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "not": {"type": "array"}}
    proc = JSONSchemaLogitsProcessor(schema, tok)
    proc.grammars[0].checks.max_attempts = 5
    rows = _generate(random_llama, tok, proc, 1, 80, seed=0)
    assert rows[0][1] and proc.finish_reasons[0].startswith("check_failed: 'not' at #"), proc.finish_reasons


# ------------------------------------------------------------------------------- speculative decoding, engine
@pytest.mark.parametrize("family", ["not", "uniqueItems", "oneOf", "dependentSchemas"])
def test_speculative_decoding_validates(stories, family):
    """Speculative generate() (early-exit drafter): drafts are cut by the same checked matcher. Families whose
    checks always leave a valid continuation here (no check_failed end to tell apart in the returned tensor; the
    retry of rows whose check failed: tests/test_grammar_retry_engine.py)."""
    model, tok = stories
    schema = FAMILIES[family][0]
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    prompt = tok(["Once upon a time"], return_tensors="pt")
    for sample in (False, True):
        torch.manual_seed(4)
        out = model.generate(
            **prompt, max_new_tokens=60, do_sample=sample, response_format=fmt, tokenizer=tok, assistant_early_exit=3
        )
        text = tok.decode(out[0, prompt.input_ids.shape[1] :], skip_special_tokens=True)
        ended = tok.eos_token_id in out[0, prompt.input_ids.shape[1] :].tolist()
        assert not ended or _is_valid(schema, text), (family, text)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_response_format_validates(stories, family):
    from hf_attn_patch.engine import Engine, SamplingParams

    model, tok = stories
    schema = FAMILIES[family][0]
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    engine = Engine(model, tok, block_size=4)
    params = [
        SamplingParams(max_tokens=60, temperature=0, response_format=fmt),
        SamplingParams(max_tokens=60, temperature=1.0, seed=2, response_format=fmt),
    ]
    outs = engine.generate(["Once upon a time", "Lily"], params)
    for out in outs:
        if out.finish_reason == "stop":
            assert _is_valid(schema, out.text), (family, out.text)
        else:  # check_failed only once the rewinds are spent
            assert out.finish_reason == "length" or out.metrics["grammar_retries"] == 3, (out.finish_reason, out.text)


# ------------------------------------------------------------------------------------- generate() retry
@pytest.mark.parametrize("family", ["if_then_else", "format_checked_here"])
def test_generate_retries_rows_whose_check_failed(random_llama, stories, family):
    """generate(response_format=...) rolls a check_failed row back to the start of the failed value, forbids the
    continuation and decodes that row again: rows the processor alone ends as check_failed come back valid.
    Declaration order: keys in any order let this random model write if_then_else's "v" before "kind", whose
    failure is then the whole object's (a retry restarts it; 3 retries do not always suffice)."""
    schema = FAMILIES[family][0]
    tok = stories[1]
    fmt = {"type": "json_schema", "json_schema": {"schema": schema, "property_order": "schema"}}
    plain = _generate(
        random_llama, tok, JSONSchemaLogitsProcessor(schema, tok, property_order="schema"), 6, 60, seed=11
    )
    torch.manual_seed(11)
    prompt = torch.tensor([[tok.bos_token_id]] * 6)
    out = random_llama.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=60,
        do_sample=True,
        response_format=fmt,
        tokenizer=tok,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    retried = []
    for row in out:
        ids = row[1:].tolist()
        assert tok.eos_token_id in ids
        retried.append(_is_valid(schema, tok.decode(ids[: ids.index(tok.eos_token_id)])))
    assert sum(_is_valid(schema, text) for text, _ in plain) < 6, plain  # the case arises without retries
    assert all(retried), (family, retried)


@pytest.mark.parametrize("family", ["not", "uniqueItems", "oneOf", "dependentRequired"])
def test_server_response_format_and_tools_validate(stories, family):
    """The OpenAI server: response_format and a tool whose parameters use the keyword (tool_choice required)."""
    from hf_attn_patch.engine import Engine

    from ._server import http, running

    model, tok = stories
    schema = FAMILIES[family][0]
    params = (
        schema
        if schema.get("type") == "object"
        else {"type": "object", "properties": {"v": schema}, "required": ["v"], "additionalProperties": False}
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    with running(Engine(model, tok, block_size=8)) as (port, _):
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        status, body = http(
            port,
            "/v1/completions",
            {"prompt": "Once", "max_tokens": 60, "temperature": 0.8, "seed": 1, "response_format": fmt, "n": 2},
        )
        assert status == 200, body
        finished = 0
        for choice in body["choices"]:
            assert choice["finish_reason"] in ("stop", "length", "check_failed")
            if choice["finish_reason"] == "stop":
                assert _is_valid(schema, choice["text"]), (family, choice["text"])
                finished += 1
        status, body = http(
            port,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": tools,
                "tool_choice": "required",
                "max_tokens": 60,
                "seed": 2,
            },
        )
        assert status == 200, body
        choice = body["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            assert _is_valid(params, choice["message"]["tool_calls"][0]["function"]["arguments"]), choice
            finished += 1
        else:
            assert choice["finish_reason"] in ("length", "check_failed"), choice
        assert finished >= 2, (family, body)
