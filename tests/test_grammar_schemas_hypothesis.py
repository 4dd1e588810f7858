"""Random schemas with the keywords the grammar backend refuses (not, oneOf, if / then / else, dependentRequired,
dependentSchemas, uniqueItems, contains, float multipleOf, unknown and checked formats) and random instances:
nothing the checked grammar lets through to EOS fails jsonschema, and the exact checks never reject a valid value
the widened grammar allows."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from hf_attn_patch.grammar import GrammarError, GrammarSpec, JSONSchemaLogitsProcessor, compile_grammar
from hf_attn_patch.grammar.state import GrammarState

from .conftest import tiny_model
from .test_grammar_schemas import _generate, _is_valid, _replay, _validator

INT = st.builds(
    lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span}, st.integers(0, 5), st.integers(0, 10)
)
NUM = st.builds(
    lambda m: {"type": "number", "minimum": 0, "maximum": 3, "multipleOf": m}, st.sampled_from([0.25, 0.5, 0.1, 1.5])
)
STR = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 4)),
    st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(["zip-code", "json-pointer"])),
)
LEAF = st.one_of(st.just({"type": "boolean"}), INT, NUM, STR, st.builds(lambda v: {"const": v}, st.integers(0, 3)))


def _object(a, b, required, dep):
    schema = {"type": "object", "properties": {"a": a, "b": b}, "additionalProperties": False, "required": required}
    if dep == "required":
        schema["dependentRequired"] = {"a": ["b"]}
    elif dep == "schemas":
        schema["dependentSchemas"] = {"b": {"required": ["a"]}}
    return schema


def _array(items, unique, contains):
    schema = {"type": "array", "items": items, "maxItems": 3}
    if unique:
        schema["uniqueItems"] = True
    if contains is not None:
        schema["contains"] = contains
    return schema


def _extend(children):
    return st.one_of(
        st.builds(
            _object,
            children,
            children,
            st.sampled_from([[], ["a"], ["a", "b"]]),
            st.sampled_from([None, "required", "schemas"]),
        ),
        st.builds(_array, children, st.booleans(), st.one_of(st.none(), LEAF)),
        st.builds(lambda c, n: {**c, "not": n}, children, LEAF),
        st.builds(lambda a, b: {"oneOf": [a, b]}, children, children),
        st.builds(lambda i, t, e: {"if": i, "then": t, "else": e}, LEAF, children, children),
    )


SCHEMAS = st.recursive(LEAF, _extend, max_leaves=4)
SCALARS = st.one_of(
    st.booleans(),
    st.integers(0, 12),
    st.sampled_from([0.25, 0.5, 0.3, 1.5, 2.75, 0.1]),
    st.text(alphabet="ab/~1.", max_size=5),
)
VALUES = st.recursive(
    SCALARS,
    lambda c: st.one_of(st.lists(c, max_size=3), st.fixed_dictionaries({}, optional={"a": c, "b": c})),
    max_leaves=5,
)


def _compile(schema, tok):
    try:
        return compile_grammar(GrammarSpec.json_schema(schema), tok)
    except GrammarError:
        assume(False)


def _plain_accepts(grammar, text: str) -> bool:
    """The widened grammar alone (no checks) takes `text` to EOS."""
    adapter = grammar.adapter
    state = GrammarState(grammar.backend.matcher(grammar._compiled), adapter.eos_token_ids, adapter.vocab_size)
    ids = adapter.llguidance_tokenizer().tokenize_str(text)
    return state.accept_tokens(ids) == len(ids) and state.is_accepting()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(schema=SCHEMAS, value=VALUES)
def test_replay_sound_and_checks_never_reject_a_valid_value(stories, schema, value):
    grammar = _compile(schema, stories[1])
    text = json.dumps(value)
    accepted = _replay(grammar, text)
    valid = _validator(schema).is_valid(value)
    event(f"accepted={accepted} valid={valid} checks={grammar.checks is not None}")
    if accepted:
        assert valid, (schema, text)
    elif valid and _plain_accepts(grammar, text):
        pytest.fail(f"a check rejected a valid value: {schema} {text}")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # sampled rows: one float path


@pytest.fixture(scope="module")
def random_llama(stories):
    return tiny_model("llama", vocab_size=512, seed=5)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
def test_generated_rows_that_end_validate(stories, random_llama, schema, seed):
    """A random model sampling under the processor: every row that ends with EOS validates, unless its finish
    reason says check_failed."""
    tok = stories[1]
    grammar = _compile(schema, tok)
    proc = JSONSchemaLogitsProcessor(schema, tok)
    assert proc.grammars[0] is grammar
    for (text, ended), reason in zip(_generate(random_llama, tok, proc, 2, 40, seed), proc.finish_reasons):
        event(f"ended={ended} reason={(reason or '').split(':')[0]}")
        if ended and not (reason or "").startswith("check_failed"):
            assert _is_valid(schema, text), (schema, text, reason)
