"""Context retrieval probes (hf_attn_patch/evaluation/retrieval.py): the items hold what they claim at the stated
distance, the score is the greedy accuracy computed from full logits, every model answers the same items, bad input is named.

stories260k scores near zero on random-token retrieval (it copies stories, not arbitrary tokens), so these tests
check the machinery; the quality bounds of real conversions are in tests/test_stories15m.py and BENCHMARKS.md.
"""

from __future__ import annotations

import pytest
import torch

from hf_attn_patch.evaluation import retrieval
from hf_attn_patch.evaluation.retrieval import (
    Batch,
    copy_batch,
    distances,
    evaluate_retrieval,
    induction_batch,
    RetrievalResult,
    known_vocabulary,
    passkey_batch,
    score,
    vocabulary,
)


@pytest.fixture(scope="module")
def vocab(stories):
    return known_vocabulary(*stories)


def reference_score(model, batch: Batch) -> float:
    """The same accuracy from the full logits [n, L, vocab], position by position."""
    with torch.no_grad():
        logits = model(batch.ids).logits
    per_item = []
    for row, mask, out in zip(batch.ids, batch.targets, logits):
        hits = [int(out[i - 1].argmax()) == int(row[i]) for i in range(len(row)) if mask[i]]
        per_item.append(hits)
    if batch.exact:
        return sum(all(h) for h in per_item) / len(per_item)
    return sum(map(sum, per_item)) / sum(map(len, per_item))


def test_items_hold_the_answer_at_the_distance(stories, vocab):
    _, tokenizer = stories
    gen = torch.Generator().manual_seed(0)
    copy = copy_batch(vocab, 24, 3, gen, [1])
    assert copy.ids.shape == (3, 1 + 48) and torch.equal(copy.ids[:, 1:25], copy.ids[:, 25:])
    assert copy.targets.sum() == 3 * 23 and not copy.exact  # the second copy but its first token
    induction = induction_batch(vocab, 40, 4, gen, [1])
    for row in induction.ids.tolist():
        a, b = row[-2], row[-1]
        assert a != b and row.count(a) == 2 and row.count(b) == 2  # A B once, then A -> B: nothing else to copy
        first = row.index(a)
        assert row[first + 1] == b and len(row) - 2 - first == 40
    assert induction.targets[:, -1].all() and induction.targets.sum() == 4
    passkey = passkey_batch(tokenizer, 80, 3, gen)
    for row, mask in zip(passkey.ids.tolist(), passkey.targets.tolist()):
        key = [t for t, m in zip(row, mask) if m]
        start = next(i for i in range(len(row)) if row[i : i + len(key)] == key)
        assert mask.index(True) - start == 80 and len(key) >= 5  # the key's digits, 80 tokens apart


def test_score_matches_the_full_logits_and_every_model_answers_the_same_items(stories, vocab):
    model, tokenizer = stories
    gen = torch.Generator().manual_seed(1)
    for batch in (
        copy_batch(vocab, 30, 3, gen, [1]),
        induction_batch(vocab, 20, 5, gen, [1]),
        passkey_batch(tokenizer, 64, 3, gen),
    ):
        assert score(model, batch) == pytest.approx(reference_score(model, batch), abs=1e-12)
    first = evaluate_retrieval(model, tokenizer, items=2, vocab=vocab, largest=64)
    again = evaluate_retrieval(model, tokenizer, items=2, vocab=vocab, largest=64)
    assert first.to_dict() == again.to_dict()
    assert RetrievalResult.from_dict(first.to_dict()).to_dict() == first.to_dict()  # the benchmarks' reused rows
    assert set(first.accuracy) == set(retrieval.TASKS)
    assert all(0 <= a <= 1 for acc in first.accuracy.values() for a in acc.values())


def test_distances_reach_the_context_and_the_items_fit(stories, vocab):
    model, tokenizer = stories
    context = model.config.max_position_embeddings
    gen = torch.Generator().manual_seed(2)
    for task in retrieval.TASKS:
        grid = distances(tokenizer, context, task)
        assert grid == sorted(set(grid)) and grid[0] >= 16
        longest = retrieval.make_batch(task, tokenizer, vocab, grid[-1], 1, gen)
        assert longest.ids.shape[1] <= context
        assert longest.ids.shape[1] > context - 40  # up to the context (copy: two segments of half of it)
    assert distances(tokenizer, context, "copy", largest=100) == [16, 32, 64, 100]


def test_whole_run_on_stories260k_is_fast_and_complete(stories):
    result = evaluate_retrieval(*stories, items=2)
    assert result.context == stories[0].config.max_position_embeddings and result.extra["vocab"] >= 16
    assert max(result.accuracy["induction"]) > result.context - 40
    assert retrieval.table({"a": result, "b": result}).count("\n") == 3


def test_vocabulary_keeps_ordinary_pieces_only(stories):
    _, tokenizer = stories
    pieces = tokenizer.convert_ids_to_tokens(vocabulary(tokenizer).tolist())
    assert not any(p.startswith("<") or any(c.isdigit() for c in p) for p in pieces)


@pytest.mark.parametrize("options, message", [
    (dict(tasks=("passkey", "needle")), r"tasks=\['passkey', 'needle'\]: each must be one of"),
    (dict(tasks=()), r"tasks=\[\]"),
    (dict(items=0), "items=0 must be a positive integer"),
    (dict(tasks=("passkey",), largest=4), r"smallest=16, largest=4: no distance of \['passkey'\] fits"),
])  # fmt: skip
def test_bad_input_is_named(stories, options, message):
    with pytest.raises(ValueError, match=message):
        evaluate_retrieval(*stories, **options)
