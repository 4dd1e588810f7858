"""Batched sampler: per-row settings as tensors, checked against a one-row reference and statistically."""

from __future__ import annotations

import torch

from hf_attn_patch.engine.params import SamplingParams
from hf_attn_patch.engine.sampler import SamplingBatch, process, sample, token_logprobs

V = 50


def _one_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The textbook definition on one row [V]: temperature, keep the top_k largest, keep the smallest most-likely
    set with mass >= top_p."""
    scores = logits / p.temperature
    keep = torch.ones(V, dtype=torch.bool)
    order = scores.argsort(descending=True)
    if p.top_k:
        keep[order[p.top_k :]] = False
    if p.top_p < 1:
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        mass = 0.0
        for rank, t in enumerate(order.tolist()):
            if rank > 0 and mass >= p.top_p:
                keep[t] = False
            mass += float(probs[t])
    return scores.masked_fill(~keep, float("-inf"))


def _batch(params, generators=None, drafts=None):
    generators = generators or [None] * len(params)
    return SamplingBatch.build(params, generators, drafts or [[] for _ in params], V)


def test_process_matches_one_row_reference():
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.6), (2.0, 1, 1.0), (1.0, 0, 0.05)]
    ]
    logits = torch.randn(len(params), V) * 3
    got = process(logits[:, None], _batch(params))[:, 0]
    for row, p in zip(range(len(params)), params):
        want = _one_row(logits[row], p)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want))
        torch.testing.assert_close(got[row][torch.isfinite(want)], want[torch.isfinite(want)])


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    tokens = sample(logits, _batch(params)).tokens
    for r in range(0, 6, 2):
        assert tokens[r] == [int(logits[r].argmax())]


def test_sampled_distribution_converges_to_the_processed_one():
    """20000 rows of the same logits, top-k 8 / top-p 0.9 / T 0.8: empirical frequencies within 4 sigma of p."""
    torch.manual_seed(2)
    logits = torch.randn(V) * 2
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.9)
    n = 20000
    tokens = sample(logits.expand(n, V).clone(), _batch([p] * n)).tokens
    counts = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).double() / n
    target = _one_row(logits, p).softmax(-1).double()
    sigma = (target * (1 - target) / n).sqrt()
    assert (counts - target).abs().le(4 * sigma + 1e-12).all() and counts[target == 0].sum() == 0


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    p = SamplingParams(temperature=1.0, seed=11)
    alone = sample(logits[2:3], _batch([p], [torch.Generator().manual_seed(11)])).tokens[0]
    params = [SamplingParams(temperature=1.0)] * 2 + [p, SamplingParams(temperature=0.5)]
    gens = [None, None, torch.Generator().manual_seed(11), None]
    for _ in range(3):  # whatever the unseeded rows draw
        assert sample(logits, _batch(params, gens)).tokens[2] == alone
        gens[2] = torch.Generator().manual_seed(11)


def test_speculative_rows_verified_together():
    """Request 0 greedy with 2 drafts (the first equals the argmax), request 1 sampled with 1 point-mass draft: the
    first token request 1 emits is distributed as p_0 (rejection sampling is exact)."""
    torch.manual_seed(4)
    rows0 = torch.randn(3, V)
    draft0 = [int(rows0[0].argmax()), (int(rows0[1].argmax()) + 1) % V]
    out = sample(rows0, _batch([SamplingParams(temperature=0)], drafts=[draft0]))
    assert out.tokens[0] == [draft0[0], int(rows0[1].argmax())] and int(out.accepted[0]) == 1
    logits = torch.randn(2, V)
    n = 20000
    params = [SamplingParams(temperature=1.0)] * n
    draft = int(logits[0].argsort()[-2])  # a likely but not the likeliest token
    res = sample(logits.repeat(n, 1), _batch(params, drafts=[[draft]] * n))
    first = torch.tensor([t[0] for t in res.tokens])
    freq = torch.bincount(first, minlength=V).double() / n
    target = logits[0].softmax(-1).double()
    assert (freq - target).abs().le(4 * (target * (1 - target) / n).sqrt() + 1e-12).all()


def test_token_logprobs_are_of_the_raw_distribution():
    torch.manual_seed(5)
    raw = torch.randn(3, V)
    tokens = torch.tensor([4, 9, 0])
    entries = token_logprobs(raw, tokens, 3)
    logp = raw.log_softmax(-1)
    for row, e in enumerate(entries):
        assert e.token_id == int(tokens[row]) and abs(e.logprob - float(logp[row, tokens[row]])) < 1e-6
        values, ids = logp[row].topk(3)
        assert [t for t, _ in e.top] == ids.tolist() and all(
            abs(a - b) < 1e-6 for (_, a), b in zip(e.top, values.tolist())
        )


def test_seeded_speculative_rows_do_not_depend_on_the_others_drafts():
    """A seeded request with 1 draft draws the same noise whether the batch's longest draft is 1 or 4."""
    torch.manual_seed(6)
    logits = torch.randn(2, V)
    other = torch.randn(5, V)
    for seed in range(20):  # with the longest draft's worth drawn, most of these would differ
        p = SamplingParams(temperature=1.0, seed=seed)
        alone = sample(logits, _batch([p], [torch.Generator().manual_seed(seed)], [[3]]))
        both = sample(
            torch.cat([logits, other]),
            _batch(
                [p, SamplingParams(temperature=0.7)], [torch.Generator().manual_seed(seed), None], [[3], [1, 2, 3, 4]]
            ),
        )
        assert both.tokens[0] == alone.tokens[0]
