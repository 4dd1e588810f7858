"""Batched sampling for the engine: R requests at once, each with 1 + d_r logit rows (d_r speculative drafts).

    sampled, logprobs = sample_requests(logits, plan.sampling, masks)   # a step's draws, per request id
    prompt = prompt_logprobs(logits, plan.prompt_logprobs)              # a step's prompt scores, per request id
    batch = SamplingBatch.build(params, generators, drafts)             # per-row tensors, built once per step
    result = sample(logits, batch)                                      # logits float32 [sum(1 + d_r), V]

Per request r with rows j = 0..d_r (row j scores the token after draft j - 1):
- processed scores s = logits / T_r, then top-k (the k_r largest kept) and top-p (the smallest set of most likely
  tokens with mass >= p_r kept), all as [R, k+1, V] tensor ops (no Python loop over rows or the vocabulary);
- greedy rows (T_r = 0) take argmax(logits); the others are verified / sampled by rejection sampling
  (speculative/rejection.py) on softmax(s), its draws coming from per-row noise: a seeded request draws its noise
  from its own torch.Generator, so its tokens do not depend on what else is in the batch;
- a categorical draw is the exponential race argmax_v p_v / E_v, E_v ~ Exp(1) i.i.d. (exact: P(v wins) = p_v);
- logprobs are of the raw distribution log_softmax(logits) (before temperature, top-k / top-p and grammar masks:
  callers pass the unmasked logits as `raw`), chosen token + the `logprobs_k` most likely.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..speculative.rejection import verify_greedy, verify_sampling
from .grammar_link import GrammarMasks
from .params import SamplingParams, TokenLogprob
from .scheduler_output import PromptLogprobRows, SamplingView


@dataclass
class SamplingBatch:
    """Per-request sampling settings as tensors (CPU). R requests; k = max drafts."""

    temperature: torch.Tensor  # [R] float (1.0 where greedy: unused there)
    greedy: torch.Tensor  # [R] bool
    top_k: torch.Tensor  # [R] long, V where off
    top_p: torch.Tensor  # [R] float
    drafts: torch.Tensor  # [R, k] long (0-padded)
    draft_lengths: torch.Tensor  # [R] long
    generators: list  # [R] torch.Generator or None
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool

    @staticmethod
    def build(params: list[SamplingParams], generators: list, drafts: list[list[int]], vocab_size: int):
        greedy = [p.temperature == 0 for p in params]
        k = max((len(d) for d in drafts), default=0)
        padded = torch.zeros((len(params), k), dtype=torch.long)
        for r, d in enumerate(drafts):
            if d:
                padded[r, : len(d)] = torch.tensor(d)
        lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        if all(greedy):  # the common serving case: nothing else is needed
            off = torch.empty(0)
            return SamplingBatch(off, off, off, off, padded, lengths, list(generators), True, False, False)
        top_k = [p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size for p, g in zip(params, greedy)]
        top_p = [p.top_p if not g else 1.0 for p, g in zip(params, greedy)]
        return SamplingBatch(
            temperature=torch.tensor([1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]),
            greedy=torch.tensor(greedy),
            top_k=torch.tensor(top_k),
            top_p=torch.tensor(top_p, dtype=torch.float32),
            drafts=padded,
            draft_lengths=lengths,
            generators=list(generators),
            all_greedy=all(greedy),
            use_top_k=any(t < vocab_size for t in top_k),
            use_top_p=any(p < 1.0 for p in top_p),
        )


@dataclass
class SampleResult:
    accepted: torch.Tensor  # [R] drafts accepted
    tokens: list[list[int]]  # per request: accepted drafts + the next token (1 + accepted[r] tokens)


def sample_requests(logits: torch.Tensor, sampling: dict[str, SamplingView], masks: GrammarMasks | None):
    """A step's draws: logits float32 [N, V] (the plan's kept rows), the requests reaching their next token (one
    with max_tokens=0 only scores its prompt: nothing is drawn), their grammar masks -> (per request id its accepted
    drafts + next token, per request id that asked for logprobs a TokenLogprob of each drawn token)."""
    views = {request_id: view for request_id, view in sampling.items() if view.params.max_tokens > 0}
    if not views:
        return {}, {}
    spans = [(view.row, 1 + len(view.draft)) for view in views.values()]
    offsets = list(itertools.accumulate((n for _, n in spans[:-1]), initial=0))
    first = dict(zip(views, offsets))  # each request's first row in `raw`
    if sum(n for _, n in spans) == logits.shape[0]:  # only sampling rows were kept (no prompt logprobs)
        raw = logits
    else:
        raw = logits[torch.cat([torch.arange(row, row + n) for row, n in spans])]
    rows = raw
    if masks is not None:  # logprobs are of the raw distribution: mask a copy
        rows = raw.clone()
        masks.apply(rows, [first[request_id] for request_id in masks.req_ids])
    batch = SamplingBatch.build(
        [view.params for view in views.values()],
        [view.generator for view in views.values()],
        [view.draft for view in views.values()],
        rows.shape[-1],
    )
    sampled = {request_id: tuple(tokens) for request_id, tokens in zip(views, sample(rows, batch).tokens)}
    wanted = [
        (first[request_id] + j, request_id, token)
        for request_id, tokens in sampled.items()
        if views[request_id].params.logprobs is not None
        for j, token in enumerate(tokens)
    ]
    logprobs = {}
    if wanted:  # one batched op over every wanted row
        k = max(views[request_id].params.logprobs for _, request_id, _ in wanted)
        index, targets = torch.tensor([w[0] for w in wanted]), torch.tensor([w[2] for w in wanted])
        for (_, request_id, _), entry in zip(wanted, token_logprobs(raw[index], targets, k)):
            entry.top = entry.top[: views[request_id].params.logprobs]
            logprobs.setdefault(request_id, []).append(entry)
    return sampled, {request_id: tuple(entries) for request_id, entries in logprobs.items()}


def prompt_logprobs(logits: torch.Tensor, rows: dict[str, PromptLogprobRows]) -> dict[str, tuple[TokenLogprob, ...]]:
    """logits float32 [N, V] (the plan's kept rows) -> per request id a TokenLogprob of each prompt token it scores
    (all requests' rows at once)."""
    if not rows:
        return {}
    index = torch.tensor([r.row + j for r in rows.values() for j in range(len(r.targets))])
    targets = torch.tensor([t for r in rows.values() for t in r.targets])
    entries = iter(token_logprobs(logits[index], targets, max(r.k for r in rows.values())))
    result = {}
    for request_id, r in rows.items():
        result[request_id] = tuple(itertools.islice(entries, len(r.targets)))
        for entry in result[request_id]:
            entry.top = entry.top[: r.k]
    return result


def ragged_to_padded(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """logits [sum(1 + d_r), V] (request r's rows contiguous) -> [R, k+1, V]; padding rows repeat the last row."""
    starts = torch.cumsum(1 + lengths, 0) - (1 + lengths)
    index = starts[:, None] + torch.minimum(torch.arange(k + 1)[None, :], lengths[:, None])
    return logits[index]


def process(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """scores [R, k+1, V] -> temperature / top-k / top-p applied per request (a new tensor; masked = -inf)."""
    scores = scores / batch.temperature.to(scores.device)[:, None, None]
    if not (batch.use_top_k or batch.use_top_p):
        return scores
    sorted_scores, order = scores.sort(-1, descending=True)
    V = scores.shape[-1]
    drop = torch.zeros_like(sorted_scores, dtype=torch.bool)
    if batch.use_top_k:
        drop |= torch.arange(V, device=scores.device) >= batch.top_k.to(scores.device)[:, None, None]
    if batch.use_top_p:
        probs = sorted_scores.masked_fill(drop, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens: keep while it is below top_p
        drop |= before >= batch.top_p.to(scores.device)[:, None, None]
    drop[..., 0] = False  # the most likely token always stays
    return scores.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))


def _noise(batch: SamplingBatch, width: int, kind: str) -> torch.Tensor:
    """[R, width] i.i.d. uniform (one per draft: a seeded row draws only its own drafts' worth, so its stream does
    not depend on the others' draft lengths) or Exp(1) noise; seeded requests' rows from their own generators."""
    draw = (lambda t, g: t.uniform_(generator=g)) if kind == "uniform" else (lambda t, g: t.exponential_(generator=g))
    out = draw(torch.empty((len(batch.generators), width)), None)
    for r, g in enumerate(batch.generators):
        if g is not None:
            draw(out[r, : int(batch.draft_lengths[r])] if kind == "uniform" else out[r], g)
    return out


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """logits float32 [sum(1 + d_r), V] (already grammar-masked where constrained) -> accepted drafts and tokens."""
    R, k = batch.drafts.shape
    if batch.all_greedy and k == 0:  # one row per request: its argmax
        return SampleResult(torch.zeros(R, dtype=torch.long), [[t] for t in logits.argmax(-1).tolist()])
    scores = ragged_to_padded(logits, batch.draft_lengths, k)  # [R, k+1, V]
    if batch.all_greedy:
        accepted, nxt = verify_greedy(scores, batch.drafts, batch.draft_lengths)
    else:
        accepted, nxt = verify_greedy(scores, batch.drafts, batch.draft_lengths)
        sampled = ~batch.greedy
        idx = sampled.nonzero().squeeze(1)
        sub = SamplingBatch(
            batch.temperature[idx],
            batch.greedy[idx],
            batch.top_k[idx],
            batch.top_p[idx],
            batch.drafts[idx],
            batch.draft_lengths[idx],
            [batch.generators[i] for i in idx.tolist()],
            False,
            batch.use_top_k,
            batch.use_top_p,
        )
        probs = process(scores[idx], sub).softmax(-1)
        s_acc, s_next = verify_sampling(
            probs,
            sub.drafts,
            sub.draft_lengths,
            None,
            uniform=_noise(sub, k, "uniform"),
            race=_noise(sub, probs.shape[-1], "exponential"),
        )
        accepted, nxt = accepted.clone(), nxt.clone()
        accepted[idx], nxt[idx] = s_acc, s_next
    counts, nexts, drafts = accepted.tolist(), nxt.tolist(), batch.drafts.tolist()
    return SampleResult(accepted, [drafts[r][: counts[r]] + [nexts[r]] for r in range(R)])


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprob]:
    """raw logits [N, V], tokens [N] (the token at each position), k alternatives -> N TokenLogprob of the raw
    distribution log_softmax(raw)."""
    if raw.shape[0] == 0:
        return []
    logp = raw.float().log_softmax(-1)
    chosen = logp.gather(1, tokens[:, None].to(logp.device)).squeeze(1).tolist()
    if k:
        values, ids = logp.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in chosen]
    return [TokenLogprob(int(t), lp, top) for t, lp, top in zip(tokens.tolist(), chosen, tops)]
