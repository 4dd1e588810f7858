"""The held-in retrieval criterion (evaluation/held_in.py: repeat_items, repeat_kl): items S + F + S cut from held-in
text, KL(source || model) on the second copy. stories260k checks the machinery (it barely copies: its loss on a
second copy of TinyStories text is no lower than on the first); SmolLM2-135M, which copies, checks that the
criterion sees retrieval: a model whose attention window just misses the first copy scores far worse than one whose
window just reaches it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from hf_attn_patch.converters.io.calibration import read_calibration_text
from hf_attn_patch.evaluation import held_in
from hf_attn_patch.evaluation.held_in import repeat_items, repeat_kl, repeat_source_log_probs, repeat_token_kl

TEXT = read_calibration_text(None)[-20_000:]


def test_items_repeat_the_segment_at_the_distance_asked():
    ids = torch.arange(1000, 9000)  # distinct tokens: where each came from is readable
    items = repeat_items(ids, distances=(16, 100, 300), items=3, segment=16, seed=0)
    assert list(items.windows) == [16, 100, 300] and len(items) == 9 and items.segment == 16
    for d, windows in items.windows.items():
        assert windows.shape == (3, d + 16)
        for row in windows.tolist():
            start = row[0]
            assert row[:d] == list(range(start, start + d))  # S and the text that follows it
            assert row[d:] == row[:16]  # S again, starting d tokens after the first copy starts
        assert list(items.targets(d)) == list(range(d + 1, d + 16))  # its tokens 2..16, each d after its copy
    again = repeat_items(ids, distances=(16, 100, 300), items=3, segment=16, seed=0)
    assert all(torch.equal(again.windows[d], items.windows[d]) for d in items.windows)  # deterministic
    assert not torch.equal(repeat_items(ids, (300,), items=3, segment=16, seed=1).windows[300], items.windows[300])
    alone = repeat_items(ids, (300,), items=3, segment=16, seed=0)  # a distance's items do not depend on the others
    assert torch.equal(alone.windows[300], items.windows[300])


def test_items_from_windows_stay_inside_one_window():
    windows = torch.arange(4 * 200).view(4, 200)  # row r holds 200r .. 200r + 199
    items = repeat_items(windows, distances=(50, 150), items=8, segment=10, seed=3)
    rows = set()
    for d, ws in items.windows.items():
        for row in ws.tolist():
            assert row[:d] == list(range(row[0], row[0] + d)) and row[0] // 200 == (row[0] + d + 9) // 200
            rows.add(row[0] // 200)
    assert len(rows) > 1  # items are drawn from several windows


def test_items_refuse_bad_arguments():
    ids = torch.arange(500)
    for kwargs, match in (
        (dict(segment=1), "segment=1"),
        (dict(items=0), "items=0"),
        (dict(distances=(8,)), "distances \\[8\\]"),
        (dict(distances=(64, 64)), "distinct"),
        (dict(distances=(600,)), "distance 600: an item holds D \\+ segment = 616 tokens"),
    ):
        with pytest.raises(ValueError, match=match):
            repeat_items(ids, **{"distances": (64,), "items": 1, "segment": 16, **kwargs})
    with pytest.raises(ValueError, match="held_in: token ids"):
        repeat_items(ids.float(), (64,), items=1, segment=16)
    with pytest.raises(ValueError, match="held_in: token ids"):
        repeat_items(ids.view(5, 10, 10), (8,), items=1, segment=4)


def test_repeat_kl_is_zero_for_the_source_and_positive_for_a_perturbed_model(stories, one_torch_thread, monkeypatch):
    model, tokenizer = stories
    ids = tokenizer(TEXT, return_tensors="pt", add_special_tokens=False).input_ids[0]
    items = repeat_items(ids, distances=(24, 200), items=2, segment=16)
    same = repeat_kl(model, model, items)
    assert set(same) == {"repeat:24", "repeat:200", "repeat_all"}  # no "repeat_long": no D >= LONG
    assert all(abs(v) < 1e-6 for v in same.values())
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    kl = repeat_token_kl(other, model, items)
    assert kl[200].shape == (2, 15) and (kl[200] > 0).all() and (kl[24] > 0).all()
    # the KL of the full forward's predictions at the scored positions, computed the long way
    window = items.windows[200][1]
    with torch.no_grad():
        p = model(window[None]).logits[0].log_softmax(-1)
        q = other(window[None]).logits[0].log_softmax(-1)
    scored = [t - 1 for t in items.targets(200)]  # the logits at t - 1 predict the token at t
    manual = (p[scored].exp() * (p[scored] - q[scored])).sum(-1)
    assert torch.allclose(kl[200][1], manual, atol=1e-5)  # fp32 logits of 512 classes, summed: ~1e-6 apart
    logp = repeat_source_log_probs(model, items)
    assert logp.shape == (4, 15, model.config.vocab_size)
    cached = repeat_kl(other, logp, items)
    assert cached == pytest.approx(repeat_kl(other, model, items), abs=1e-7)  # the cached form
    assert cached["repeat_all"] == pytest.approx((cached["repeat:24"] + cached["repeat:200"]) / 2)
    with pytest.raises(ValueError, match="do not fit the items"):
        repeat_kl(other, logp[:3], items)
    monkeypatch.setattr(held_in, "LONG", 200)
    assert repeat_kl(other, logp, items)["repeat_long"] == pytest.approx(cached["repeat:200"])


def windowed(model, window: int | None):
    """model's weights in a Mistral (a Llama with sliding-window attention): each position sees the last `window`."""
    fields = {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "model_type")}
    out = MistralForCausalLM(MistralConfig(**{**fields, "sliding_window": window})).eval()
    out.load_state_dict(model.state_dict())
    return out


@pytest.mark.smollm2
def test_a_window_that_misses_the_first_copy_has_a_large_repeat_kl(one_torch_thread):
    from hf_attn_patch.models.pretrained import load_smollm2

    source, tokenizer = load_smollm2()
    ids = tokenizer(TEXT, return_tensors="pt", add_special_tokens=False).input_ids[0]
    d = 256
    items = repeat_items(ids, distances=(d,), items=4, segment=32)
    logp = repeat_source_log_probs(source, items)
    assert repeat_kl(windowed(source, None), logp, items)[f"repeat:{d}"] < 1e-6  # the Mistral form is the source
    # each scored query needs the token d - 1 back: a window of d + 16 reaches it, d - 16 does not. The two windows
    # lose the same far context elsewhere, so only the criterion's scoring of the second copy tells them apart.
    # Measured: 1.99 without the copy, 0.04 with it.
    misses = repeat_kl(windowed(source, d - 16), logp, items)[f"repeat:{d}"]
    reaches = repeat_kl(windowed(source, d + 16), logp, items)[f"repeat:{d}"]
    assert misses > 0.5 and misses > 10 * reaches
