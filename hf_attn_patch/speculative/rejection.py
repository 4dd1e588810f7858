"""Verification of draft tokens: per-row acceptance, exact for greedy and for sampling.

Sampling follows speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft token d_j, drawn
from the drafter's q_j, is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the next
token is drawn from the normalized residual max(0, p_j - q_j); if all drafts pass, one more token is drawn from
p_k. Every emitted token is then distributed exactly as under the target's p. A drafter without probabilities
(n-gram lookup) is a point mass, q_j = onehot(d_j): accept with probability p_j(d_j), residual = p_j without d_j.
"""

from __future__ import annotations

import torch


def verify_greedy(target_scores: torch.Tensor, drafts: torch.Tensor, draft_lengths: torch.Tensor):
    """target_scores [B, k+1, V] (processed), drafts [B, k], draft_lengths [B] -> (accepted [B], next_token [B]).

    Row b accepts drafts while they equal the target's argmax; its next token is the argmax after them."""
    best = target_scores.argmax(-1)  # [B, k+1]
    accepted = _leading_true(drafts == best[:, :-1], draft_lengths)
    return accepted, best.gather(1, accepted[:, None]).squeeze(1)


def verify_sampling(
    target_probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_lengths: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
    *,
    uniform: torch.Tensor | None = None,
    race: torch.Tensor | None = None,
):
    """target_probs [B, k+1, V], drafts [B, k], draft_lengths [B], draft_probs [B, k, V] or None (point mass)
    -> (accepted [B], next_token [B]), by rejection sampling (module docstring).

    The randomness may be given (per-row seeded draws, the engine's sampler): uniform [B, k] U(0, 1) for the
    acceptance tests, race [B, V] Exp(1) for the categorical draw argmax_v residual_v / race_v; else both come
    from `generator`."""
    batch, k = drafts.shape
    p_draft = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(2)  # p_j(d_j)  [B, k]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(2, drafts[..., None]).squeeze(2)
    if uniform is None:
        uniform = torch.rand(p_draft.shape, generator=generator, device=p_draft.device, dtype=p_draft.dtype)
    accepted = _leading_true(uniform * q_draft < p_draft, draft_lengths)  # u < p/q, without dividing by q = 0

    rows = torch.arange(batch, device=drafts.device)
    p_next = target_probs[rows, accepted]  # [B, V]
    rejected = accepted < draft_lengths
    at = accepted.clamp(max=max(k - 1, 0))
    if k == 0:
        q_next = torch.zeros_like(p_next)
    elif draft_probs is None:
        q_next = torch.nn.functional.one_hot(drafts[rows, at], p_next.shape[-1]).to(p_next.dtype)
    else:
        q_next = draft_probs[rows, at]
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp(min=0), p_next)
    # p == q at a rejected position can only happen through rounding (acceptance was then certain): fall back to p
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    if race is not None:
        next_token = (residual / race.to(residual.device).clamp(min=1e-30)).argmax(-1)  # race > 0: no 0 / 0
    else:
        next_token = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator).squeeze(1)
    return accepted, next_token


def _leading_true(matches: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Number of leading True per row of matches [B, k], at most lengths[b]."""
    k = matches.shape[1]
    within = torch.arange(k, device=matches.device)[None, :] < lengths[:, None]
    return (matches & within).long().cumprod(1).sum(1)
