"""Long-context measures and healing on long windows: the repeated-passage probe (evaluation/passage.py), the held-in
long-context criterion (evaluation/held_in.py) and heal_len. Few items on stories260k: checks of the machinery; the
SmolLM2 figures are in BENCHMARKS.md (scripts/bench_long_context.py probe)."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_attn_patch.converters.io.calibration import read_calibration_text
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.evaluation.held_in import SHORT, long_context_kl, position_kl, source_log_probs, token_kl
from hf_attn_patch.evaluation.passage import LEAD, evaluate_passages, fact_batch, passage_batch
from hf_attn_patch.evaluation.retrieval import Batch, score

from ._fast import FAST
from .test_retrieval import reference_score

TEXT = read_calibration_text(None)[-20_000:]


def test_passage_items_repeat_the_passage_after_the_text_that_follows_it():
    ids = torch.arange(1000, 3000)  # distinct tokens: where each came from is readable
    batch = passage_batch(ids, gap=50, items=3, gen=torch.Generator().manual_seed(0), bos=[1], passage=20)
    assert batch.ids.shape == (3, 1 + 20 + 50 + 20) and not batch.exact
    for row, mask in zip(batch.ids.tolist(), batch.targets.tolist()):
        start = row[1]
        assert row[1:71] == list(range(start, start + 70))  # P and the 50 tokens after it in the text
        assert row[71:] == row[1:21]  # P again
        assert [i for i, m in enumerate(mask) if m] == list(range(72, 91))  # its tokens 2..20, 70 after their copy
    with pytest.raises(ValueError, match="fewer than passage \\+ gap"):
        passage_batch(ids[:60], gap=50, items=1, gen=torch.Generator(), bos=[], passage=20)


def test_fact_items_state_a_fact_then_ask_it_after_the_gap(stories):
    _, tokenizer = stories
    ids = tokenizer(TEXT, return_tensors="pt", add_special_tokens=False).input_ids[0]
    batch = fact_batch(ids, tokenizer, gap=120, items=4, gen=torch.Generator().manual_seed(1), bos=[1])
    assert batch.exact and batch.ids.shape[0] == 4
    for row, mask in zip(batch.ids, batch.targets):
        value = tokenizer.decode(row[mask]).strip()
        assert len(value) == 6 and value[:5].isdigit() and value.endswith(".")  # the 5 digits and the full stop
        text = tokenizer.decode(row)
        question = text[text.rindex("The code of the") : text.rindex(value)].strip()
        told = text.index(question)  # stated once before the gap, asked once at the end
        assert text.count(question) == 2 and text[told + len(question) :].lstrip().startswith(value)
        first = [i for i in range(len(row) - 5) if tokenizer.decode(row[i : i + 5]).strip().startswith("The code")]
        distance = int(mask.nonzero()[0, 0]) - first[0]
        assert distance > 120  # the value lies the gap (and the question) after its statement
    with pytest.raises(ValueError, match=f"fewer than {LEAD} \\+ gap"):
        fact_batch(ids[:50], tokenizer, gap=100, items=1, gen=torch.Generator(), bos=[])


def test_passage_score_is_the_greedy_accuracy_and_the_model_copies(stories, one_torch_thread):
    model, tokenizer = stories
    ids = tokenizer(TEXT, return_tensors="pt", add_special_tokens=False).input_ids[0]
    batch = passage_batch(ids, gap=40, items=4, gen=torch.Generator().manual_seed(3), bos=[1], passage=32)
    second = score(model, batch)
    assert second == pytest.approx(reference_score(model, batch), abs=1e-12)
    first = torch.zeros_like(batch.targets)
    first[:, 2:33] = True  # the first copy's tokens 2..32: predicted from the prior alone
    assert second > score(model, Batch(batch.ids, first, exact=False)) + 0.05  # it reads the earlier copy
    result = evaluate_passages(model, tokenizer, {"stories": TEXT, "again": TEXT}, gaps=(20, 60), items=2)
    again = evaluate_passages(model, tokenizer, {"stories": TEXT}, gaps=(20, 60), items=2)
    assert set(result.accuracy) == {"passage:stories", "passage:again"} and list(
        result.accuracy["passage:stories"]
    ) == [20, 60]
    assert result.accuracy["passage:stories"] == again.accuracy["passage:stories"]  # the same items every run
    with pytest.raises(ValueError, match="over the model's context"):
        evaluate_passages(model, tokenizer, {"stories": TEXT}, gaps=(10_000,), items=1)
    with pytest.raises(ValueError, match="items=0"):
        evaluate_passages(model, tokenizer, {"stories": TEXT}, items=0)
    facts = evaluate_passages(model, tokenizer, {"stories": TEXT}, (), items=2, facts=(30,))
    assert list(facts.accuracy) == ["facts:stories"] and 0 <= facts.accuracy["facts:stories"][30] <= 1


def test_held_in_criterion_splits_short_and_long_positions(stories, one_torch_thread):
    model, _ = stories
    windows = torch.randint(3, 500, (2, 300), generator=torch.Generator().manual_seed(0))
    assert token_kl(model, model, windows).abs().max() < 1e-6  # a model against itself
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn_like(p))
    kl = token_kl(other, model, windows)
    assert kl.shape == (2, 300) and (kl > 0).all()
    assert torch.allclose(token_kl(other, source_log_probs(model, windows), windows), kl)  # the cached form
    bins = position_kl(kl, bins=(128, 256, 1024))
    assert set(bins) == {"0-127", "128-255", "256-299", "short", "all"}  # no "long": the windows stop before 1,024
    assert bins["short"] == pytest.approx(float(kl[:, :SHORT].mean()))
    assert bins["all"] == pytest.approx((128 * bins["0-127"] + 128 * bins["128-255"] + 44 * bins["256-299"]) / 300)
    long = position_kl(torch.cat([kl] * 4, dim=1))  # 1,200 positions
    assert long["long"] == pytest.approx(float(torch.cat([kl] * 4, 1)[:, 1024:].mean()))
    assert long_context_kl(other, model, windows) == position_kl(kl)


def test_heal_len_options():
    with pytest.raises(ValueError, match="heal_len=512 applies to healing only"):
        ConvertOptions.from_flat(to="mqa", heal_len=512)
    with pytest.raises(ValueError, match="heal_len=0 must be a positive integer"):
        ConvertOptions.from_flat(to="mqa", heal_steps=1, heal_len=0)
    opts = ConvertOptions.from_flat(to="mqa", heal_steps=1, calib_len=64)
    assert opts.healing.length == 64 and ConvertOptions.from_flat(**opts.flat()) == opts  # default: calib_len


def test_healing_on_windows_longer_than_the_calibration(tmp_path, one_torch_thread):
    report = convert(
        "default",
        tmp_path / "o",
        to="mqa",
        method="pca",
        heal_steps=2,
        heal_len=160,
        heal_lr=1e-4,
        heal_batch_size=1,
        heal_held_in=1,
        heal_layerwise_steps=0,
        calib_samples=4,
        calib_len=64,
        **FAST,
    )
    heal = report["heal"]
    assert heal["length"] == 160 and heal["tokens"] == 2 * 160 and heal["windows"] == 2
    assert report["options"]["heal_len"] == 160
