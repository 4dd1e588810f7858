"""Adaptive draft length: each round picks the k that maximizes expected emitted tokens per second.

Row b accepts each draft token with probability a_b (estimated online, recent rounds weigh more), so a round with
draft length k emits E_b(k) = 1 + a_b + ... + a_b^k tokens for that row. A round costs
t(k) = v(k) + d * k: verifying k + 1 tokens (the mean verification time of k where seen, else a line v0 + v1 k
through those means, until two k's are seen assuming each extra token adds 10% of a round; made non-decreasing in
k) plus drafting, d seconds per draft token (measured on its own). Both are kept per k / per token, so rounds
without drafts do not erase what drafting costs. We pick k* = argmax_k sum_b E_b(k) / t(k) over 0..max_length,
where k = 0 is plain decoding, so a drafter that is rarely right or too slow costs little. While k* = 0, a k = 1
probe keeps the estimates fresh; the gap between probes (16 rounds) doubles, up to 64, each time a probe accepts
nothing, and is never shorter than what keeps probing within PROBE_BUDGET of the time: a probe costs
(v(1) + d - v(0)) / v(0) rounds more than a plain one (on a CPU, where verifying a second token per row can cost
nearly a whole round, that is a gap of ~75 rounds).
"""

from __future__ import annotations

import math

import torch

PROBE_BUDGET = 0.02  # share of the decoding time that probes (k = 1 while k* = 0) may cost


class DraftLength:
    def __init__(
        self,
        max_length: int,
        batch_size: int,
        adaptive: bool = True,
        start: int | None = None,
        forget: float = 0.8,
        probe_every: int = 16,
    ):
        if max_length < 1:
            raise ValueError(f"draft length: max_length must be >= 1, got {max_length}")
        self.max_length, self.adaptive, self.forget, self.probe_every = max_length, adaptive, forget, probe_every
        self.current = min(max_length, start if start is not None else 4) if adaptive else max_length
        # acceptance evidence per row: accepted and attempted draft tokens (a weak prior of 1 in 2)
        self.accepted = torch.full((batch_size,), 1.0, dtype=torch.float64)
        self.attempted = torch.full((batch_size,), 2.0, dtype=torch.float64)
        self._verify = [None] * (max_length + 1)  # per k: recency-weighted mean verification seconds (None: unseen)
        self._draft_per_token: float | None = None  # recency-weighted mean drafting seconds per draft token
        self._rounds_at_zero = 0
        self._evidence = False
        self._probe_gap = probe_every
        self._probing = False

    def acceptance(self) -> torch.Tensor:
        return self.accepted / self.attempted

    def choose(self) -> int:
        if not self.adaptive:
            return self.max_length
        if not self._evidence:  # no draft verified yet: keep the starting length
            return self.current
        ks = torch.arange(self.max_length + 1, dtype=torch.float64)
        a = self.acceptance().clamp(max=0.999)[:, None]
        emitted = ((1 - a ** (ks + 1)) / (1 - a)).sum(0)  # [K]: expected tokens of the whole batch
        seconds = (self._verify_seconds(ks) + (self._draft_per_token or 0.0) * ks).clamp(min=1e-9)
        best = int((emitted / seconds).argmax())
        if best > 0:
            self._rounds_at_zero, self._probe_gap = 0, self.probe_every
        else:
            self._rounds_at_zero += 1
            probe_cost = float(seconds[1] - seconds[0]) / float(seconds[0])  # in plain rounds
            if self._rounds_at_zero >= max(self._probe_gap, math.ceil(probe_cost / PROBE_BUDGET)):
                best, self._rounds_at_zero, self._probing = 1, 0, True
        self.current = best
        return best

    def update(
        self, k: int, accepted: torch.Tensor, proposed: torch.Tensor, verify_seconds: float, draft_seconds: float = 0.0
    ) -> None:
        """After a round with draft length k: accepted [B] of proposed [B] draft tokens per row, and the round's
        verification and drafting times. Rows that proposed nothing (an n-gram miss costs nothing) carry no
        evidence about acceptance."""
        if self._probing:
            self._probing = False
            if int(accepted.sum()) == 0:
                self._probe_gap = min(2 * self._probe_gap, 64)
        if k > 0:
            tried = (proposed > 0).double().cpu()
            self._evidence = self._evidence or bool(tried.any())
            rejected = (accepted < proposed).double().cpu()  # a row's first rejection ends its run
            self.accepted = self.forget * self.accepted + tried * accepted.double().cpu()
            self.attempted = self.forget * self.attempted + tried * (accepted.double().cpu() + rejected)
            self._draft_per_token = self._mean(self._draft_per_token, draft_seconds / k)
        self._verify[k] = self._mean(self._verify[k], verify_seconds)

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.cpu()
        self.accepted, self.attempted = self.accepted[rows], self.attempted[rows]

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else self.forget * old + (1 - self.forget) * new

    def _verify_seconds(self, ks: torch.Tensor) -> torch.Tensor:
        """Predicted verification seconds for each k: the measured mean where k was seen, the line elsewhere, made
        non-decreasing in k (on a CPU the cost jumps at the first extra token per row and then flattens, which a
        line alone would get wrong for small k)."""
        v0, v1 = self._fit_verify()
        line = v0 + v1 * ks
        measured = torch.tensor([float("nan") if t is None else t for t in self._verify], dtype=torch.float64)
        return torch.where(measured.isnan(), line, measured).cummax(0).values

    def _fit_verify(self) -> tuple[float, float]:
        """(v0, v1) of verify(k) = v0 + v1 k: least squares through the per-k means seen so far."""
        points = [(k, t) for k, t in enumerate(self._verify) if t is not None]
        if len(points) == 1:
            k, t = points[0]
            v0 = t / (1 + 0.1 * k)
            return v0, 0.1 * v0
        ks, ts = torch.tensor(points, dtype=torch.float64).T
        dk = ks - ks.mean()
        v1 = max(float((dk * (ts - ts.mean())).sum() / (dk * dk).sum()), 0.0)
        return max(float(ts.mean()) - v1 * float(ks.mean()), 1e-9), v1
