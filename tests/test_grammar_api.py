"""Grammar package plumbing: response_format / grammar= keywords, backend selection, tokenizer adaptation, SmolLM2."""

from __future__ import annotations

import builtins
import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessorList

from hf_attn_patch.grammar import (
    BackendUnavailableError,
    GrammarConstrainedLogitsProcessor,
    GrammarError,
    GrammarSpec,
    JSONSchemaLogitsProcessor,
    RegexLogitsProcessor,
    get_adapter,
    processor_from_generate_kwargs,
    token_bytes,
)
from hf_attn_patch.models.pretrained import DEFAULT_MODEL_DIR


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------------------- processor_from_generate_kwargs
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def test_generate_kwargs_forms(stories):
    model, tok = stories
    assert processor_from_generate_kwargs() is None
    assert processor_from_generate_kwargs(response_format={"type": "text"}, tokenizer=tok) is None
    assert processor_from_generate_kwargs(response_format=[{"type": "text"}] * 2) is None
    rf = {"type": "json_schema", "json_schema": {"name": "r", "strict": True, "schema": SCHEMA}}
    proc = processor_from_generate_kwargs(response_format=rf, tokenizer=tok)
    assert isinstance(proc, GrammarConstrainedLogitsProcessor)
    ids = tok(["Hello"], return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=20, logits_processor=LogitsProcessorList([proc]))
    assert json.loads(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)) in ({"ok": True}, {"ok": False})
    proc = processor_from_generate_kwargs(response_format={"type": "json_object"}, tokenizer=tok, backend="xgrammar")
    assert proc.backend == "xgrammar"
    # one entry per row, a text row included; grammar= forms
    mixed = processor_from_generate_kwargs(response_format=[rf, {"type": "text"}], tokenizer=tok)
    assert [g.spec.kind for g in mixed.grammars] == ["json_schema", "regex"]
    for g in [
        "start: /[ab]+/",
        'root ::= "x"',
        {"type": "regex", "pattern": "[0-9]+"},
        {"type": "lark", "grammar": 'start: "a"'},
        {"type": "gbnf", "grammar": 'root ::= "b"'},
        {"type": "choice", "choices": ["a", "b"]},
        {"type": "json_schema", "schema": SCHEMA},
    ]:
        assert isinstance(processor_from_generate_kwargs(grammar=g, tokenizer=tok), GrammarConstrainedLogitsProcessor)
    kinds = [
        g.spec.kind
        for g in processor_from_generate_kwargs(grammar=['start: "a"', 'root ::= "x"'], tokenizer=tok).grammars
    ]
    assert kinds == ["lark", "gbnf"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}), r"^tokenizer"),
        (dict(response_format={"type": "xml"}), r"response_format\['type'\].*'xml'"),
        (dict(response_format={"type": "json_schema"}), r"response_format\['json_schema'\]"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), r"\['schema'\]: missing"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": [1]}}), r"\['schema'\].*list"),
        (dict(response_format="json"), r"^response_format: expected a dict"),
        (dict(response_format=[]), r"non-empty list"),
        (dict(response_format=[{"type": "text"}, {"type": "nope"}]), r"response_format\[1\]\['type'\]"),
        (dict(grammar={"type": "regex"}), r"grammar\['pattern'\]: missing"),
        (dict(grammar={"type": "choice", "choices": []}), r"grammar\['choices'\]"),
        (dict(grammar={"type": "cfg", "grammar": "x"}), r"grammar\['type'\].*'cfg'"),
        (dict(grammar=42), r"^grammar: expected"),
        (dict(grammar="start: /a/", response_format={"type": "json_object"}), "not both"),
    ],
)
def test_generate_kwargs_errors(stories, kwargs, match):
    tok = None if "tokenizer" in match else stories[1]
    with pytest.raises(ValueError, match=match):
        processor_from_generate_kwargs(tokenizer=tok, **kwargs)


def test_generate_kwargs_unsupported_feature(stories):
    rf = {"type": "json_schema", "json_schema": {"schema": {"type": "array", "items": {"$ref": "#/$defs/none"}}}}
    with pytest.raises(GrammarError, match=r"'\$ref' at #/items"):
        processor_from_generate_kwargs(response_format=rf, tokenizer=stories[1])


def test_per_row_spec_count_must_divide_batch(stories):
    _, tok = stories
    proc = JSONSchemaLogitsProcessor([SCHEMA, SCHEMA, SCHEMA], tok)
    with pytest.raises(ValueError, match="3 grammars"):
        proc(torch.ones(4, 2, dtype=torch.long), torch.zeros(4, 512))


def test_processor_reused_across_generate_calls(stories):
    """A new prompt (or batch size) starts over; the same prompt again rolls every row back to the start."""
    model, tok = stories
    tok.pad_token, tok.padding_side = tok.unk_token, "left"
    proc = RegexLogitsProcessor("[a-z]{3,6}", tok)
    outs = []
    for prompt in (["Once"], ["The cat sat", "A dog"], ["The cat sat", "A dog"]):
        enc = tok(prompt, return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=10, logits_processor=LogitsProcessorList([proc]), pad_token_id=0)
        texts = [tok.decode(r[enc.input_ids.shape[1] :], skip_special_tokens=True) for r in out]
        assert all(re.fullmatch("[a-z]{3,6}", t) for t in texts), texts
        assert proc.prompt_len == enc.input_ids.shape[1] and len(proc.states) == len(prompt)
        outs.append(texts)
    assert outs[1] == outs[2]  # greedy: the reused processor behaves like a fresh one


# ------------------------------------------------------------------------------------------------- backend selection
def _hide(monkeypatch, name):
    real = builtins.__import__

    def fake(mod, *a, **k):
        if mod == name or mod.startswith(name + "."):
            raise ImportError(f"No module named {name!r} (hidden by the test)")
        return real(mod, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)


def test_auto_falls_back_to_xgrammar_and_explicit_missing_raises(stories, monkeypatch):
    _, tok = stories
    _hide(monkeypatch, "llguidance")
    assert RegexLogitsProcessor("b+", tok).backend == "xgrammar"
    with pytest.raises(BackendUnavailableError, match="backend='llguidance'.*cannot be imported"):
        RegexLogitsProcessor("b+", tok, backend="llguidance")


def test_no_backend_at_all_raises(stories, monkeypatch):
    _hide(monkeypatch, "llguidance")
    real = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda m, *a, **k: (_ for _ in ()).throw(ImportError(m)) if m.startswith("xgrammar") else real(m, *a, **k),
    )
    with pytest.raises(BackendUnavailableError, match="no grammar backend"):
        RegexLogitsProcessor("c+", stories[1])


def test_backends_are_imported_lazily():
    """No module of the package imports llguidance or xgrammar at module level (CPU users without them can import)."""
    import ast
    import pathlib

    import hf_attn_patch.grammar as pkg

    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] in ("llguidance", "xgrammar") for n in names), (path.name, names)


# ----------------------------------------------------------------------------------------------- tokenizer adaptation
def _smollm2_tokenizer():
    from hf_attn_patch.models.pretrained import smollm2_dir

    try:
        return AutoTokenizer.from_pretrained(smollm2_dir())
    except ImportError as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("which", ["stories260k", pytest.param("smollm2", marks=pytest.mark.smollm2)])
def test_token_bytes_match_xgrammar_decoding(stories, which):
    """Our own vocabulary decoding (used for slow tokenizers) agrees with xgrammar's for SentencePiece+byte-fallback
    (stories260k) and byte-level BPE (SmolLM2), special tokens excluded."""
    import xgrammar as xgr

    tok = stories[1] if which == "stories260k" else _smollm2_tokenizer()
    ours, special = token_bytes(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    theirs = info.decoded_vocab
    assert set(special) >= set(tok.all_special_ids)
    diff = [i for i in range(len(tok)) if i not in special and ours[i] != theirs[i]]
    assert diff == [], [(i, ours[i], theirs[i]) for i in diff[:5]]
    assert ours[tok.convert_tokens_to_ids("<0x7B>" if which == "stories260k" else "{")] == b"{"


def test_adapter_cached_per_tokenizer_and_vocabulary(stories):
    _, tok = stories
    a = get_adapter(tok)
    assert get_adapter(tok) is a
    again = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)  # a second load of the same vocabulary
    assert get_adapter(again) is a
    assert get_adapter(tok, eos_token_id=[2, 0]) is not a and get_adapter(tok, eos_token_id=[0, 2]).eos_token_ids == (
        0,
        2,
    )
    assert a.llguidance_tokenizer() is a.llguidance_tokenizer()
    with pytest.raises(GrammarError, match="eos_token_id"):
        get_adapter(tok, eos_token_id=-1)
    with pytest.raises(GrammarError, match="tokenizer"):
        get_adapter("gpt2")


def test_multiple_eos_ids(stories):
    """With eos_token_id=[2, 0] both ids end a row, and neither is allowed before the grammar accepts."""
    _, tok = stories
    proc = RegexLogitsProcessor("[0-9]{2}", tok, eos_token_id=[2, 0])
    one = tok.convert_tokens_to_ids("<0x31>")
    proc(torch.tensor([[1]]), torch.zeros(1, 512))  # fixes the prompt length: 1
    m = torch.isfinite(proc(torch.tensor([[1, one]]), torch.zeros(1, 512)))[0]
    assert not m[0] and not m[2]
    m = torch.isfinite(proc(torch.tensor([[1, one, one]]), torch.zeros(1, 512)))[0]
    assert m.nonzero().flatten().tolist() == [0, 2]


# ------------------------------------------------------------------------------------------------------- SmolLM2-135M
FUNCTION_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_time"]},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smollm2():
    from hf_attn_patch.models.pretrained import load_smollm2

    try:
        return load_smollm2()
    except ImportError as err:
        pytest.skip(str(err))


def _chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


@pytest.mark.smollm2
def test_smollm2_function_call_and_regex_batch(smollm2):
    """Rows with different constraints on the real model; both outputs validate. Row 1's regex forbids what the model
    writes unconstrained (it answers in words), so the processor visibly changes the output."""
    model, tok = smollm2
    tok.padding_side = "left"
    prompts = [
        _chat(tok, "Call a function to get the weather in Paris. Answer in JSON."),
        _chat(tok, "What year did the Apollo 11 mission land on the moon?"),
    ]
    enc = tok(prompts, return_tensors="pt", padding=True)
    schema_proc = processor_from_generate_kwargs(
        grammar=[{"type": "json_schema", "schema": FUNCTION_CALL}, {"type": "regex", "pattern": r"Year: [0-9]{4}"}],
        tokenizer=tok,
    )
    out = model.generate(
        **enc, max_new_tokens=40, logits_processor=LogitsProcessorList([schema_proc]), pad_token_id=tok.pad_token_id
    )
    texts = [tok.decode(r[enc.input_ids.shape[1] :], skip_special_tokens=True) for r in out]
    call = json.loads(texts[0])
    jsonschema.validate(call, FUNCTION_CALL)
    assert re.fullmatch(r"Year: [0-9]{4}", texts[1]), texts[1]
    plain = model.generate(**enc, max_new_tokens=12, pad_token_id=tok.pad_token_id)
    assert not re.fullmatch(r"Year: [0-9]{4}", tok.decode(plain[1, enc.input_ids.shape[1] :], skip_special_tokens=True))


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_decoded_vocabulary_fallback_gives_the_same_masks(stories, monkeypatch, backend):
    """When a backend cannot read the tokenizer itself (slow tokenizers), the adapter feeds it our decoded vocabulary:
    along a valid output, the masks agree with the backend's own reader on every token whose bytes are unique in the
    vocabulary (byte-fallback pieces duplicate some merged tokens; a backend may keep only one of them)."""
    import llguidance.hf
    import xgrammar

    from hf_attn_patch.grammar.backends import resolve_backend
    from hf_attn_patch.grammar.state import GrammarState
    from hf_attn_patch.grammar.vocab import TokenizerAdapter

    _, tok = stories
    spec = GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {"w": {"type": "string", "maxLength": 6}},
            "required": ["w"],
            "additionalProperties": False,
        }
    )
    be = resolve_backend(backend)
    native = TokenizerAdapter(tok, (tok.eos_token_id,), "native")

    def boom(*a, **k):
        raise TypeError("not a fast tokenizer (simulated)")

    fallback = TokenizerAdapter(tok, (tok.eos_token_id,), "fallback")
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", boom)
    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", staticmethod(boom))
    states = []
    for adapter in (native, fallback):
        if adapter is native:
            monkeypatch.undo()
        compiled = be.compile(spec, adapter)
        states.append(
            GrammarState(
                be.matcher(compiled),
                adapter.eos_token_ids,
                adapter.vocab_size,
                backend,
                banned_token_ids=adapter.special_token_ids,
            )
        )
        monkeypatch.setattr(llguidance.hf, "from_tokenizer", boom)
        monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", staticmethod(boom))
    ids = tok('{"w": "héé"}', add_special_tokens=False).input_ids[1:]  # drop SentencePiece's prefix '▁'
    vocab, special = token_bytes(tok)
    counts = {}
    for b in vocab:
        counts[b] = counts.get(b, 0) + 1
    unique = torch.tensor([counts[b] == 1 or i in special for i, b in enumerate(vocab)])
    for t in ids + [tok.eos_token_id]:
        a, b = states[0].allowed_mask(), states[1].allowed_mask()
        assert torch.equal(a[unique], b[unique]), (t, (a != b).nonzero().flatten().tolist())
        assert not a[[0, 1]].any() and not b[[0, 1]].any()  # <unk>, <s>: special, never allowed
        assert states[0].accept_token(t) and states[1].accept_token(t)
    assert states[1].is_terminated()
