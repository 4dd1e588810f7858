"""The sensitivity measurement, layer-streamed: kl[l][k] = KL(source || source with layer l's attention replaced by
candidate k) per token, on the first `count` calibration windows (budgets.MEASURE_TOKENS tokens).

Pass 0 runs the source over the windows (one layer resident at a time) to the reference log-probabilities
log p = log_softmax(lm_head(norm(H_L))). For each layer l, in order, with H_l (the source's residual stream at
layer l's input, carried), every lossy candidate k runs as layer l's attention on H_l; the K outputs are then carried
together through layers l+1..L-1, each read once for all of them, to log q_k; KL_k = mean_t sum_v p (log p - log q_k).
Layer reads: L + L(L-1)/2; memory: the resident parts + one layer + (K + 2) x count x T x D activations, whatever
the depth. Every batch is the `count` windows at once, as the whole-model measurement ran them, so the values are
the same.
"""

from __future__ import annotations

import logging

import torch

from ..methods.budgets import LayerCandidates
from ..io.layer_source import LayerSource
from ..io.layer_stream import LayerRunner

logger = logging.getLogger(__name__)


class Measurement:
    """Carries the measured windows' source track; `layer(l, layer, candidates)` measures layer l, then advances."""

    def __init__(self, src: LayerSource, windows: torch.Tensor):
        self.src, self.count = src, len(windows)
        self.runner = LayerRunner(src, windows.shape[1], len(windows))  # one batch: the whole-model pass's
        shape = (len(windows), windows.shape[1], src.config.hidden_size)
        self.hidden = torch.empty(shape, dtype=src.dtype, device=src.device)
        self.runner.embed(windows, self.hidden)
        with torch.no_grad():
            h = self.hidden
            for i in range(src.num_layers):
                h = self._apply(src.layer(i), i, h)
            self.reference = torch.log_softmax(src.head(h).float(), dim=-1)
        self.probs = self.reference.exp()

    @torch.no_grad()
    def _apply(self, layer, i: int, h: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(h)
        self.runner.apply(layer, i, h, out)
        return out

    @torch.no_grad()
    def layer(self, l: int, layer: torch.nn.Module, candidates: LayerCandidates) -> list[float]:
        """KL per candidate of layer l (an exact candidate: 0, not run); `layer`: the source's decoder layer l."""
        name, source_attn = self.src.attention(layer)
        outs, lossy = [], [k for k, c in enumerate(candidates.options) if not c.exact]
        try:
            for k in lossy:
                setattr(layer, name, candidates.module(k).to(self.src.device))
                outs.append(self._apply(layer, l, self.hidden))
        finally:
            setattr(layer, name, source_attn)
        for j in range(l + 1, self.src.num_layers):
            if not outs:
                break
            later = self.src.layer(j)
            outs = [self._apply(later, j, h) for h in outs]
            del later
        kl = [0.0] * len(candidates.options)
        for k, h in zip(lossy, outs):
            logq = torch.log_softmax(self.src.head(h).float(), dim=-1)
            kl[k] = float((self.probs * (self.reference - logq)).sum(-1).mean())
        self.hidden = self._apply(layer, l, self.hidden)  # the source's layer l: H_{l+1}
        return kl
