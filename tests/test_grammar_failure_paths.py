"""Failed exact checks on every path (plain processor, generate(), speculative generate(), engine, server) with a
random-weight model: every output is valid or names its failure. A row out of attempts ends with the smallest
valid completion; a row with no valid continuation ends with EOS and ``check_failed``, which generate() reports in
its output's ``finish_reasons``, the engine and the server in ``finish_reason``."""

from __future__ import annotations


import pytest
import torch

import hf_attn_patch.grammar.schema_checks as schema_checks
from hf_attn_patch.grammar import JSONSchemaLogitsProcessor

from .conftest import tiny_model
from .test_grammar_schemas import _is_valid

# no value of "v" is valid: every row that ends must name check_failed
NO_VALID_VALUE = {
    "$comment": "failure paths",
    "type": "object",
    "required": ["v"],
    "additionalProperties": False,
    "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 5, "not": {"type": "integer"}}},
}
# valid documents exist, but a random model keeps closing the array without a 7: its one attempt runs out
NEEDS_A_SEVEN = {
    "$comment": "failure paths",
    "type": "array",
    "maxItems": 6,
    "contains": {"const": 7},
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
}
SCHEMAS = {"no_valid_value": NO_VALID_VALUE, "needs_a_seven": NEEDS_A_SEVEN}


@pytest.fixture
def one_attempt(monkeypatch):
    monkeypatch.setattr(schema_checks, "MAX_ATTEMPTS", 1)


@pytest.fixture(scope="module")
def random_llama(stories):
    return tiny_model("llama", vocab_size=512, seed=3)


def _fmt(schema):
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def _judge(schema, text: str, reason: str, completed: list) -> None:
    """Valid, or the failure named; a row cut by the token limit is a prefix of the grammar."""
    if reason in ("eos", "stop"):
        assert _is_valid(schema, text), (text, reason)
        completed.append(text)
    else:
        # the engine and the server say "check_failed" (OpenAI's field holds a word); generate() names the keyword
        assert reason in ("length", "check_failed") or reason.startswith("check_failed: 'not' at #/properties/v"), (
            text,
            reason,
        )


def _rows(tok, out, prompt_len: int):
    for row in out[:, prompt_len:].tolist():
        ended = tok.eos_token_id in row
        yield tok.decode(row[: row.index(tok.eos_token_id)] if ended else row, skip_special_tokens=True), ended


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_plain_processor(random_llama, stories, one_attempt, name):
    tok, schema = stories[1], SCHEMAS[name]
    proc = JSONSchemaLogitsProcessor(schema, tok)
    torch.manual_seed(1)
    prompt = torch.tensor([[tok.bos_token_id]] * 6)
    out = random_llama.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=60,
        do_sample=True,
        logits_processor=[proc],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    completed = []
    for (text, ended), reason in zip(_rows(tok, out, 1), proc.finish_reasons):
        _judge(schema, text, reason or ("eos" if ended else "length"), completed)
    if name == "needs_a_seven":  # out of attempts: finished with a valid completion, not failed
        assert len(completed) == 6, completed


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_generate_and_speculative(random_llama, stories, one_attempt, name):
    schema = SCHEMAS[name]
    model, tok = stories
    for extra, m, n in (({}, random_llama, 1), ({"assistant_early_exit": 2}, model, None)):
        prompt = (
            torch.tensor([[tok.bos_token_id]] * 4) if n else tok(["Once upon a time"], return_tensors="pt").input_ids
        )
        torch.manual_seed(2)
        out = m.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=60,
            do_sample=True,
            response_format=_fmt(schema),
            tokenizer=tok,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
            **extra,
        )
        assert len(out.finish_reasons) == out.shape[0]
        completed = []
        for (text, _), reason in zip(_rows(tok, out, prompt.shape[1]), out.finish_reasons):
            _judge(schema, text, reason, completed)
        if name == "no_valid_value":
            assert not completed
            assert any(r.startswith("check_failed") for r in out.finish_reasons), out.finish_reasons


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_engine_and_server(random_llama, stories, one_attempt, name):
    from hf_attn_patch.engine import Engine, SamplingParams

    from ._server import http, running

    tok, schema = stories[1], SCHEMAS[name]
    engine = Engine(random_llama, tok, block_size=8)
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, response_format=_fmt(schema)) for s in range(4)]
    completed = []
    for out in engine.generate([[tok.bos_token_id]] * 4, params):
        _judge(schema, out.text, out.finish_reason, completed)
    with running(Engine(random_llama, tok, block_size=8)) as (port, _):
        status, body = http(
            port,
            "/v1/completions",
            {
                "prompt": "Once",
                "max_tokens": 60,
                "temperature": 1.0,
                "seed": 3,
                "response_format": _fmt(schema),
                "n": 3,
            },
        )
        assert status == 200, body
        for choice in body["choices"]:
            _judge(schema, choice["text"], choice["finish_reason"], completed)
    assert bool(completed) == (name == "needs_a_seven"), completed


def test_engine_dead_end_is_not_a_stop(stories):
    """A grammar that allows no token the model can sample (here: only 'Z', outside a 440-token model's logits;
    in the wild: a grammar backend's error such as llguidance's lexer limit) ends with the forced EOS and the
    finish reason "dead_end", never "stop" with an incomplete answer."""
    from hf_attn_patch.engine import Engine, SamplingParams

    tok = stories[1]
    engine = Engine(tiny_model("llama", vocab_size=440, seed=3), tok, block_size=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, grammar={"type": "regex", "pattern": "ZZ"})
    out = engine.generate([[tok.bos_token_id]], [params])[0]
    assert out.finish_reason == "dead_end" and out.text == "", (out.finish_reason, out.text)
