"""Large real-world-like schemas keep their structure when the backend refuses parts of them: 60 definitions,
recursive ``$ref`` chains with sibling keywords, ``allOf`` of objects, references to the root, in draft-04 and
2020-12. The widening happens at one place each (a reference's siblings, the reference itself), never the whole
document: the root's type, known properties, required and additionalProperties stay in the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from hf_attn_patch.grammar import GrammarSpec, JSONSchemaLogitsProcessor, compile_grammar
from hf_attn_patch.grammar.backends import LLGuidanceBackend
from hf_attn_patch.grammar.errors import GrammarError
from hf_attn_patch.grammar.formats import format_checker

from .conftest import tiny_model
from .test_grammar_schemas import _replay

DRAFTS = {
    "draft-04": ("http://json-schema.org/draft-04/schema#", "definitions"),
    "2020-12": ("https://json-schema.org/draft/2020-12/schema", "$defs"),
}
N_DEFS = 60


def large_schema(draft: str) -> dict:
    """A news-content-like schema: root object = allOf of a base object and a typed one, 60 trait definitions, a
    recursive chain d0 -> d1 -> ... -> d0 through references with sibling keywords, items referring back to the
    root (``$ref: "#"``) beside sibling keywords, and keywords the backend refuses (not, dependencies, oneOf)."""
    uri, box = DRAFTS[draft]
    ref = f"#/{box}/"
    defs = {}
    for i in range(N_DEFS):
        defs[f"d{i}"] = {
            "type": "object",
            "description": f"trait {i}",
            "additionalProperties": False,
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9, **({"not": {"enum": [3]}} if i % 3 == 0 else {})},
                "next": {"$ref": f"{ref}d{(i + 1) % N_DEFS}", "type": "object", "description": "the next trait"},
                "body": {"oneOf": [{"$ref": "#"}, {"type": "string", "maxLength": 4}], "description": "nested"},
            },
            "required": ["v"],
        }
    defs["base"] = {
        "type": "object",
        "properties": {"id": {"type": "string", "maxLength": 6}, "trait": {"$ref": f"{ref}d0", "description": "first"}},
        "required": ["id"],
        "dependencies": {"trait": ["id"]},
    }
    defs["typed"] = {"type": "object", "properties": {"kind": {"enum": ["story", "gallery"]}}, "required": ["kind"]}
    return {
        "$schema": uri,
        "type": "object",
        "title": "A content object",
        "allOf": [{"$ref": f"{ref}base"}, {"$ref": f"{ref}typed"}],
        "properties": {
            "id": {},
            "kind": {},
            "trait": {},
            "items": {"type": "array", "maxItems": 2, "items": {"$ref": "#", "type": "object"}},
        },
        "required": ["id", "kind"],
        "additionalProperties": False,
        box: defs,
    }


VALID = [
    {"id": "a", "kind": "story"},
    {"id": "b", "kind": "gallery", "trait": {"v": 1, "next": {"v": 2}}},
    {"id": "c", "kind": "story", "items": [{"id": "d", "kind": "story", "trait": {"v": 0, "body": "x"}}]},
    {"id": "e", "kind": "story", "trait": {"v": 9, "body": {"id": "f", "kind": "gallery"}}},
]
# the same values with keys in the order llguidance gives the allOf members' properties (base, then typed)
IN_BACKEND_ORDER = [
    {"id": "a", "kind": "story"},
    {"id": "b", "trait": {"v": 1, "next": {"v": 2}}, "kind": "gallery"},
    {"id": "c", "kind": "story", "items": [{"id": "d", "trait": {"v": 0, "body": "x"}, "kind": "story"}]},
]
INVALID = [
    {"id": "a"},  # kind required
    {"id": "a", "kind": "story", "extra": 1},  # additionalProperties false
    {"id": "a", "kind": "story", "trait": {"v": 3}},  # not 3 (d0)
    {"id": "a", "kind": "story", "trait": {"v": 1, "next": {"v": 1, "next": {"v": 1, "next": {"v": 3}}}}},
    {"id": "a", "kind": "story", "items": [{"id": "b"}]},  # the root's required, one level down
    "a string",
    5,
    [1],
]  # not an object at the root


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=format_checker())


@pytest.mark.parametrize("draft", list(DRAFTS))
def test_backend_alone_refuses_it(stories, draft):
    """The case arises: llguidance alone refuses the schema (a recursive reference with sibling keywords)."""
    from hf_attn_patch.grammar.vocab import get_adapter

    with pytest.raises(GrammarError, match="circular references with sibling keys|Unimplemented keys"):
        LLGuidanceBackend().compile(
            GrammarSpec.json_schema(large_schema(draft)), get_adapter(stories[1]), json_options={"coerce_one_of": True}
        )


@pytest.mark.parametrize("order", ["schema", "any"])
@pytest.mark.parametrize("draft", list(DRAFTS))
def test_large_schema_keeps_its_structure(stories, draft, order):
    """Valid instances replay to EOS, invalid ones are caught (with keys in any order: the object keys of the
    allOf members come in an order the schema does not show; with the schema's order, the valid instances whose
    keys come in declaration order)."""
    schema = large_schema(draft)
    for v in VALID:
        assert _validator(schema).is_valid(v), v
    for v in INVALID:
        assert not _validator(schema).is_valid(v), v
    grammar = compile_grammar(GrammarSpec.json_schema(schema, order), stories[1], cache=False)
    widened = grammar.widened
    assert "*" not in widened and "lenient" not in widened, widened  # never the whole document
    if order == "schema":  # the root keeps its keywords (with keys in any order: its properties as patterns)
        assert "#" not in {p for paths in widened.values() for p in paths}, widened
    for v in VALID if order == "any" else IN_BACKEND_ORDER:
        assert _replay(grammar, json.dumps(v)), (draft, v)
    for v in INVALID:
        assert not _replay(grammar, json.dumps(v)), (draft, v)
    # the root's type is in the grammar itself: a string, a number or an array cannot even start
    state = grammar.new_state()
    lt = grammar.adapter.llguidance_tokenizer()
    for start in ('"', "5", "["):
        assert state.validate_tokens(lt.tokenize_str(start)) == 0, start
    assert state.validate_tokens(lt.tokenize_str('{"id"')) == len(lt.tokenize_str('{"id"'))


@pytest.mark.parametrize("draft", list(DRAFTS))
def test_random_model_outputs_stay_in_the_schema(stories, draft):
    """A random-weight model under the plain processor (no retry): every row that ends is valid or names its
    failure; no row leaves the grammar (a row cut by the token limit is a prefix of a valid document)."""
    tok = stories[1]
    schema = large_schema(draft)
    model = tiny_model("llama", vocab_size=512, seed=3)
    proc = JSONSchemaLogitsProcessor(schema, tok)
    torch.manual_seed(0)
    prompt = torch.tensor([[tok.bos_token_id]] * 6)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=80,
        do_sample=True,
        logits_processor=[proc],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    for row, reason in zip(out[:, 1:].tolist(), proc.finish_reasons):
        ended = tok.eos_token_id in row
        text = tok.decode(row[: row.index(tok.eos_token_id)] if ended else row)
        assert text.startswith("{"), text
        if ended and not (reason or "").startswith("check_failed"):
            assert _validator(schema).is_valid(json.loads(text)), (draft, text, reason)
