"""Adaptive draft length: each round picks the k that maximizes expected emitted tokens per second.

Row b accepts each draft token with probability a_b (estimated online, recent rounds weigh more), so a round with
draft length k emits E_b(k) = 1 + a_b + ... + a_b^k tokens for that row. A round costs t(k) = t0 + t1 * k
(verification forward plus drafting; fitted online by least squares with forgetting). We pick
k* = argmax_k sum_b E_b(k) / t(k) over 0..max_length, where k = 0 is plain decoding, so a drafter that is
rarely right or too slow costs little. While k* = 0, a k = 1 probe keeps the estimates fresh;
the gap between probes (16 rounds) doubles, up to 64, each time a probe accepts nothing.
"""

from __future__ import annotations

import torch


class DraftLength:
    def __init__(self, max_length: int, batch_size: int, adaptive: bool = True, start: int | None = None,
                 forget: float = 0.8, probe_every: int = 16):  # fmt: skip
        if max_length < 1:
            raise ValueError(f"draft length: max_length must be >= 1, got {max_length}")
        self.max_length, self.adaptive, self.forget, self.probe_every = max_length, adaptive, forget, probe_every
        self.current = min(max_length, start if start is not None else 4) if adaptive else max_length
        # acceptance evidence per row: accepted and attempted draft tokens (a weak prior of 1 in 2)
        self.accepted = torch.full((batch_size,), 1.0, dtype=torch.float64)
        self.attempted = torch.full((batch_size,), 2.0, dtype=torch.float64)
        self._sums = torch.zeros(5, dtype=torch.float64)  # weighted sums of 1, k, k^2, t, k*t for t(k) = t0 + t1 k
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
        t0, t1 = self._fit()
        ks = torch.arange(self.max_length + 1, dtype=torch.float64)
        a = self.acceptance().clamp(max=0.999)[:, None]
        emitted = ((1 - a ** (ks + 1)) / (1 - a)).sum(0)  # [K]: expected tokens of the whole batch
        best = int((emitted / (t0 + t1 * ks).clamp(min=1e-9)).argmax())
        if best > 0:
            self._rounds_at_zero, self._probe_gap = 0, self.probe_every
        else:
            self._rounds_at_zero += 1
            if self._rounds_at_zero % self._probe_gap == 0:
                best, self._rounds_at_zero, self._probing = 1, 0, True
        self.current = best
        return best

    def update(self, k: int, accepted: torch.Tensor, proposed: torch.Tensor, seconds: float) -> None:
        """After a round with draft length k: accepted [B] of proposed [B] draft tokens per row, the round's time.
        Rows that proposed nothing (an n-gram miss costs nothing) carry no evidence about acceptance."""
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
        self._sums *= self.forget
        self._sums += torch.tensor([1.0, k, k * k, seconds, k * seconds], dtype=torch.float64)

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.cpu()
        self.accepted, self.attempted = self.accepted[rows], self.attempted[rows]

    def _fit(self) -> tuple[float, float]:
        n, sk, skk, st, skt = self._sums.tolist()
        variance = n * skk - sk * sk
        if variance <= 1e-9 * max(n * skk, 1.0):  # one k seen so far: assume each draft token adds 10% of a round
            mean_k = sk / n
            t0 = (st / n) / (1 + 0.1 * mean_k)
            return t0, 0.1 * t0
        t1 = max((n * skt - sk * st) / variance, 0.0)
        return max((st - t1 * sk) / n, 1e-9), t1
