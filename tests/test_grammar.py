"""Grammar-constrained decoding: outputs validate (jsonschema with formats, regex full match) on a random-weight tiny
llama, stories260k and SmolLM2; batches with a grammar per row; beams; sampling; resync / rollback; errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import LogitsProcessorList

from hf_attn_patch.grammar import (
    ChoiceLogitsProcessor,
    GrammarError,
    GrammarLogitsProcessor,
    GrammarSpec,
    JSONSchemaLogitsProcessor,
    RegexLogitsProcessor,
    compile_grammar,
)

from .conftest import tiny_model

BACKENDS = ["llguidance", "xgrammar"]

# name -> (schema, backends that support every feature it uses)
SCHEMAS = {
    "nested_object": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "name": {"type": "string", "minLength": 1, "maxLength": 6},
                    },
                    "required": ["id", "name"],
                    "additionalProperties": False,
                },
                "active": {"type": "boolean"},
            },
            "required": ["user", "active"],
            "additionalProperties": False,
        },
        BACKENDS,
    ),
    "array_bounds": (
        {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 50}, "minItems": 2, "maxItems": 4},
        BACKENDS,
    ),
    "enum_const": (
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "v": {"const": 2},
                "n": {"enum": [1, 2.5, None, True]},
            },
            "required": ["color", "v", "n"],
            "additionalProperties": False,
        },
        BACKENDS,
    ),
    "anyof": (
        {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 9},
                {
                    "type": "object",
                    "properties": {"k": {"type": "string", "maxLength": 3}},
                    "required": ["k"],
                    "additionalProperties": False,
                },
            ]
        },
        BACKENDS,
    ),
    "ref_defs": (
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "a": {"$ref": "#/$defs/point"},
                "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
            },
            "required": ["a", "path"],
            "additionalProperties": False,
        },
        BACKENDS,
    ),
    "patterns_formats": (
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                "day": {"type": "string", "format": "date"},
                "id": {"type": "string", "format": "uuid"},
            },
            "required": ["code", "day", "id"],
            "additionalProperties": False,
        },
        BACKENDS,
    ),
    "number_bounds": (
        {
            "type": "object",
            "properties": {
                "t": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                "p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            },
            "required": ["t", "p"],
            "additionalProperties": False,
        },
        BACKENDS,
    ),
    "unicode_strings": (
        {
            "type": "object",
            "properties": {
                "word": {"type": "string", "pattern": "^[àéîõü€日本]{1,4}$"},
                "free": {"type": "string", "maxLength": 4},
            },
            "required": ["word", "free"],
            "additionalProperties": False,
        },
        BACKENDS,
    ),
    "oneof_allof": (
        {  # xgrammar: widened (oneOf as anyOf, allOf dropped) and checked exactly
            "type": "object",
            "properties": {
                "a": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 2}]},
                "b": {"allOf": [{"type": "integer", "maximum": 50}, {"minimum": 40}]},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        BACKENDS,
    ),
}


def _validator(schema):
    cls = jsonschema.Draft202012Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _is_valid(schema, text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return _validator(schema).is_valid(value)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def random_llama(stories):
    """A random-weight tiny llama over stories260k's 512-token vocabulary: it emits garbage unless constrained."""
    return tiny_model("llama", vocab_size=512, seed=3)


def _encode(tok, text: str) -> list[int]:
    """Token ids of `text` with no prefix space (SentencePiece prepends a lone '▁' piece)."""
    ids = tok(text, add_special_tokens=False).input_ids
    return ids[1:] if tok.convert_ids_to_tokens(ids[:1]) == ["▁"] else ids


def _generate(model, tok, processor, prompts, **kw):
    """Decoded continuations (special tokens dropped) of left-padded `prompts`."""
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.unk_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw.setdefault("pad_token_id", tok.pad_token_id)
    kw.setdefault("eos_token_id", tok.eos_token_id)
    procs = LogitsProcessorList([processor] if processor is not None else [])
    out = model.generate(**enc, logits_processor=procs, **kw)
    return [tok.decode(row[enc.input_ids.shape[1] :], skip_special_tokens=True) for row in out]


# --------------------------------------------------------------------------------------------------- JSON Schema
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_outputs_validate_random_model(random_llama, stories, name, backend):
    schema, supported = SCHEMAS[name]
    if backend not in supported:
        with pytest.raises(GrammarError):
            JSONSchemaLogitsProcessor(schema, stories[1], backend=backend)
        return
    proc = JSONSchemaLogitsProcessor(schema, stories[1], backend=backend)
    torch.manual_seed(0)
    texts = _generate(random_llama, stories[1], proc, ["Hi", "A cat"], max_new_tokens=120, do_sample=True)
    for text in texts:
        assert _is_valid(schema, text), (name, backend, text)
    assert proc.calls > 0


def test_unconstrained_random_model_is_invalid(random_llama, stories):
    """The baseline the constrained tests beat: the random model does not produce valid JSON by itself."""
    schema = SCHEMAS["nested_object"][0]
    torch.manual_seed(0)
    texts = _generate(random_llama, stories[1], None, ["Hi", "A cat"], max_new_tokens=40, do_sample=True)
    assert not any(_is_valid(schema, t) for t in texts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stories260k_greedy_and_sampling(stories, backend):
    model, tok = stories
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 1, "maximum": 99},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": False,
    }
    for sample in (False, True):
        torch.manual_seed(1)
        proc = JSONSchemaLogitsProcessor(schema, tok, backend=backend)
        texts = _generate(model, tok, proc, ["Once upon a time", "Lily"], max_new_tokens=90, do_sample=sample)
        assert all(_is_valid(schema, t) for t in texts), texts
        assert proc.finish_reasons == ["eos", "eos"] or all(r in (None, "eos") for r in proc.finish_reasons)


# ---------------------------------------------------------------------------------------------- regex, grammars
REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)!",
    r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,3})\.[0-9]{2}",
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_full_match(stories, random_llama, backend):
    model, tok = stories
    for i, pattern in enumerate(REGEXES):
        torch.manual_seed(i)
        proc = RegexLogitsProcessor(pattern, tok, backend=backend)
        texts = _generate(
            random_llama if i % 2 else model, tok, proc, ["The", "One day"], max_new_tokens=30, do_sample=True
        )
        for text in texts:
            assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lark_gbnf_and_choice(stories, random_llama, backend):
    _, tok = stories
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-c]{1,3}/'
    gbnf = 'root ::= "<" digit digit? ">"\ndigit ::= [0-9]'
    cases = [
        (GrammarLogitsProcessor(lark, tok, backend=backend), r"\([a-c]{1,3}(,[a-c]{1,3})*\)"),
        (GrammarLogitsProcessor(gbnf, tok, backend=backend), r"<[0-9]{1,2}>"),
        (ChoiceLogitsProcessor(["yes", "no", "don't know ✓"], tok, backend=backend), r"yes|no|don't know ✓"),
    ]
    for proc, expected in cases:
        torch.manual_seed(0)
        for text in _generate(random_llama, tok, proc, ["a", "b c"], max_new_tokens=40, do_sample=True):
            assert re.fullmatch(expected, text), (expected, text)


# ------------------------------------------------------------------------------------- batches, beams, sampling
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_with_a_schema_per_row(random_llama, stories, backend):
    _, tok = stories
    schemas = [SCHEMAS["array_bounds"][0], SCHEMAS["enum_const"][0], SCHEMAS["number_bounds"][0]]
    proc = JSONSchemaLogitsProcessor(schemas, tok, backend=backend)
    torch.manual_seed(2)
    texts = _generate(random_llama, tok, proc, ["x", "a longer prompt here", "y z"], max_new_tokens=80, do_sample=True)
    for schema, text in zip(schemas, texts):
        assert _is_valid(schema, text), (schema, text)
    # each row followed its own schema (the three shapes are mutually exclusive)
    assert isinstance(json.loads(texts[0]), list) and "color" in json.loads(texts[1]) and "t" in json.loads(texts[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_beam_search_and_num_return_sequences(random_llama, stories, backend):
    _, tok = stories
    schemas = [SCHEMAS["ref_defs"][0], SCHEMAS["anyof"][0]]
    proc = JSONSchemaLogitsProcessor(schemas, tok, backend=backend)
    texts = _generate(random_llama, tok, proc, ["x", "y y"], max_new_tokens=60, num_beams=3, num_return_sequences=2)
    assert len(texts) == 4
    for i, text in enumerate(texts):
        assert _is_valid(schemas[i // 2], text), (i, text)


def test_sampling_num_return_sequences(random_llama, stories):
    _, tok = stories
    schema = SCHEMAS["patterns_formats"][0]
    proc = JSONSchemaLogitsProcessor(schema, tok)
    torch.manual_seed(5)
    texts = _generate(random_llama, tok, proc, ["q"], max_new_tokens=80, do_sample=True, num_return_sequences=3)
    assert len(texts) == 3 and all(_is_valid(schema, t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled, not one row copied


# ---------------------------------------------------------------------------------------- errors and dead ends
def test_unsupported_features_raise_at_construction(stories):
    _, tok = stories
    with pytest.raises(GrammarError, match=r"'\$ref' at #/properties/a"):
        JSONSchemaLogitsProcessor(
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, tok, backend="llguidance"
        )
    widened = JSONSchemaLogitsProcessor(
        {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, tok, backend="xgrammar"
    )  # widened and checked, as with llguidance
    assert widened.grammars[0].widened == {"not": ["#/properties/x"]} and widened.grammars[0].checks is not None
    with pytest.raises(GrammarError, match="look-around"):
        RegexLogitsProcessor(r"(?=a)b", tok, backend="llguidance")
    with pytest.raises(GrammarError):
        GrammarLogitsProcessor("start: undefined_rule", tok)
    with pytest.raises(ValueError, match="backend"):
        JSONSchemaLogitsProcessor({"type": "object"}, tok, backend="outlines")
    assert issubclass(GrammarError, ValueError)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_end_rejected_token_forces_eos(stories, backend):
    _, tok = stories
    proc = RegexLogitsProcessor(r"[0-9]+", tok, backend=backend)
    eos = tok.eos_token_id
    prompt = torch.tensor([[1, 5, 6]])
    scores = torch.zeros(1, 512)
    proc(prompt, scores.clone())
    bad = tok.convert_tokens_to_ids("▁t")  # not a digit
    out = proc(torch.cat([prompt, torch.tensor([[bad]])], 1), torch.zeros(1, 512))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [eos]
    assert proc.finish_reasons[0].startswith("dead_end: token")
    # the forced EOS keeps the recorded reason; rolling back the bad token heals the row
    proc(torch.cat([prompt, torch.tensor([[bad, eos]])], 1), torch.zeros(1, 512))
    assert "rejected" in proc.finish_reasons[0]
    out = proc(prompt, torch.zeros(1, 512))
    assert proc.finish_reasons[0] is None and torch.isfinite(out[0]).sum() > 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_end_when_logits_narrower_than_needed(stories, backend):
    """Logits with 40 columns cannot express 'z' (byte-fallback id 125 or merged tokens above 258): dead end."""
    _, tok = stories
    proc = RegexLogitsProcessor(r"zz", tok, backend=backend)
    out = proc(torch.tensor([[1, 5]]), torch.zeros(1, 40))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [tok.eos_token_id]
    assert "no token allowed" in proc.finish_reasons[0]


def test_wider_logits_than_tokenizer_are_masked(stories):
    _, tok = stories
    proc = RegexLogitsProcessor(r"[a-z]+", tok)
    out = proc(torch.tensor([[1]]), torch.zeros(1, 600))
    assert torch.isinf(out[0, 512:]).all() and torch.isfinite(out[0, :512]).any()


# ------------------------------------------------------------------------------------ resync (speculative contract)
def _masks(proc, ids, width=512):
    return torch.isfinite(proc(ids, torch.zeros(ids.shape[0], width)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_resync_growing_then_shrinking_prefixes(stories, backend):
    _, tok = stories
    schema = SCHEMAS["nested_object"][0]
    text = '{"user": {"id": 42, "name": "Tom"}, "active": true}'
    toks = _encode(tok, text)
    prompt = [1, 7, 9]
    full = torch.tensor([prompt + toks])
    proc = JSONSchemaLogitsProcessor(schema, tok, backend=backend)
    order = [0, 3, 5, 9, 4, 4, 12, 2, len(toks), 6, 0, len(toks) - 1]  # drafts accepted, rejected, re-extended
    for n in order:
        got = _masks(proc, full[:, : len(prompt) + n])
        fresh = JSONSchemaLogitsProcessor(schema, tok, backend=backend)
        fresh(full[:, : len(prompt)], torch.zeros(1, 512))  # fixes the prompt length
        want = _masks(fresh, full[:, : len(prompt) + n])
        assert torch.equal(got, want), n
        assert proc.states[0].tokens == toks[:n]
    # the complete object: only EOS is allowed
    assert _masks(proc, full)[0].nonzero().flatten().tolist() == [tok.eos_token_id]


def test_resync_beam_reorder_matches_fresh(stories):
    _, tok = stories
    proc = RegexLogitsProcessor(r"(ab|ac|bc)+", tok)
    a, b, c = (tok.convert_tokens_to_ids(f"<0x{ord(ch):02X}>") for ch in "abc")
    rows = [[a, b, a], [a, c, b], [b, c, a]]
    prompt = torch.tensor([[1, 2]] * 3)
    proc(prompt, torch.zeros(3, 512))
    seqs = torch.cat([prompt, torch.tensor(rows)], 1)
    _masks(proc, seqs)
    permuted = seqs[[2, 0, 0]]  # beams reordered: row 0 takes old row 2, rows 1 and 2 both take old row 0
    got = _masks(proc, torch.cat([permuted, torch.tensor([[c], [c], [b]])], 1))
    fresh = RegexLogitsProcessor(r"(ab|ac|bc)+", tok)
    fresh(prompt, torch.zeros(3, 512))
    want = _masks(fresh, torch.cat([permuted, torch.tensor([[c], [c], [b]])], 1))
    assert torch.equal(got, want)
    assert proc.states[1] is not proc.states[2]


# ----------------------------------------------------------------------------------------------- GrammarState API
@pytest.mark.parametrize("backend", BACKENDS)
def test_grammar_state_api(stories, backend):
    _, tok = stories
    schema = {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}},
        "required": ["kind", "x"],
        "additionalProperties": False,
    }
    # declaration order: the first key is forced (in any order, the default, either key may come first)
    state = compile_grammar(GrammarSpec.json_schema(schema, "schema"), tok, backend=backend).new_state()
    eos = tok.eos_token_id
    good = _encode(tok, '{"kind": "point", "x": 7}')
    assert not state.allowed_mask()[eos]  # EOS only in accepting states
    forced = state.forced_tokens()
    assert tok.decode(forced).startswith('{"kind')  # the const key is forced
    assert state.validate_tokens(good + [eos]) == len(good) + 1
    assert state.validate_tokens(good[:3] + [eos]) == 3
    assert state.tokens == []
    assert state.accept_tokens(good[:5]) == 5
    clone = state.clone()
    assert state.accept_tokens(good[5:] + [eos]) == len(good) - 5 + 1
    assert state.is_terminated() and state.is_accepting()
    assert state.allowed_mask().nonzero().flatten().tolist() == [eos]
    state.rollback(2)
    assert not state.is_terminated() and state.tokens == good[:-1]
    assert clone.tokens == good[:5] and not clone.is_accepting()
    state.reset()
    assert state.tokens == [] and torch.equal(
        state.allowed_mask(),
        compile_grammar(GrammarSpec.json_schema(schema), tok, backend=backend).new_state().allowed_mask(),
    )
