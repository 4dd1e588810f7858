"""IncrementalDetokenizer: the streamed text equals decode(prompt + completion) minus decode(prompt), token by token."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hf_attn_patch.engine.detokenizer import IncrementalDetokenizer, byte_fallback_ids
from hf_attn_patch.models.pretrained import load_default


@pytest.fixture(scope="module")
def sentencepiece():
    return load_default()[1]  # stories260k: SentencePiece with byte fallback, vocab 512


@pytest.fixture(scope="module")
def bytelevel():
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from hf_attn_patch.models.pretrained import smollm2_dir

    try:
        return AutoTokenizer.from_pretrained(smollm2_dir())  # SmolLM2: byte-level BPE, vocab 49152
    except ImportError as error:
        pytest.skip(str(error))


def _check(tokenizer, prompt: list[int], completion: list[int], skip_special_tokens: bool = True) -> None:
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)  # noqa: E731
    prompt_text = decode(prompt)
    full = decode(prompt + completion)
    assume(full.startswith(prompt_text))  # else "minus decode(prompt)" is undefined (prompt ends inside a character)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    streamed, byte_pieces, in_run = "", byte_fallback_ids(tokenizer), False
    skipped = set(tokenizer.all_special_ids) if skip_special_tokens else set()
    for i, token in enumerate(completion):
        in_run = in_run if token in skipped else token in byte_pieces  # an open byte-fallback run: text unknown
        streamed += detok.add(token)
        assert streamed == detok.text
        so_far = decode(prompt + completion[: i + 1])
        if so_far.startswith(prompt_text):
            assert so_far[len(prompt_text) :].startswith(detok.text)  # never ahead of the truth, never retracted
            if not so_far.endswith("\ufffd") and not in_run:
                assert detok.text == so_far[len(prompt_text) :]  # nothing held back once characters are complete
    streamed += detok.flush()
    assert streamed == detok.text == full[len(prompt_text) :]
    assert len(detok.offsets) == len(completion)
    assert detok.offsets == sorted(detok.offsets) and all(0 <= o <= len(detok.text) for o in detok.offsets)


def _ids(vocab: int, min_size: int):
    return st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=24)


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30)


@SETTINGS
@given(prompt=_ids(512, 1), completion=_ids(512, 0), skip=st.booleans())
def test_random_tokens_sentencepiece(sentencepiece, prompt, completion, skip):
    _check(sentencepiece, prompt, completion, skip)


@SETTINGS
@given(prompt=_ids(49152, 1), completion=_ids(49152, 0), skip=st.booleans())
def test_random_tokens_bytelevel(bytelevel, prompt, completion, skip):
    _check(bytelevel, prompt, completion, skip)


@SETTINGS
@given(prompt=TEXT, completion=TEXT)
def test_unicode_text(sentencepiece, bytelevel, prompt, completion):
    """Real text with multi-byte characters (emoji, CJK: byte-fallback / byte-level pieces split them)."""
    for tokenizer in (sentencepiece, bytelevel):
        ids = tokenizer(prompt + completion, add_special_tokens=False).input_ids
        cut = len(tokenizer(prompt, add_special_tokens=False).input_ids)
        assume(0 < cut <= len(ids))
        _check(tokenizer, ids[:cut], ids[cut:])


def test_leading_space_of_the_first_word(sentencepiece):
    """SentencePiece: "named" + " Lily." (decoding the completion alone would drop the space)."""
    tok = sentencepiece
    prompt = tok("Once upon a time, there was a little girl named").input_ids
    completion = tok("Once upon a time, there was a little girl named Lily.").input_ids[len(prompt) :]
    assert tok.decode(completion).startswith("Lily")  # the bug this guards against
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(t) for t in completion] + [detok.flush()]
    assert "".join(pieces) == " Lily." and pieces[0].startswith(" ")
    assert detok.offsets[0] == 0


def test_special_tokens_skipped_or_kept(sentencepiece):
    tok = sentencepiece
    prompt = tok("The cat").input_ids
    completion = tok(" sat", add_special_tokens=False).input_ids + [tok.eos_token_id]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        for t in completion:
            detok.add(t)
        detok.flush()
        full, head = (
            tok.decode(prompt + completion, skip_special_tokens=skip),
            tok.decode(prompt, skip_special_tokens=skip),
        )
        assert detok.text == full[len(head) :] and (tok.eos_token in detok.text) == (not skip)
