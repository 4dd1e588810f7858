"""The held-in long-context criterion: KL(source || converted) per token on long samples of the source itself, by
position, with short and long positions reported apart.

Samples come from the source (calibration.teacher_windows on prompts after the calibration windows), so they are
held-in text of the source's own distribution, never evaluation text: settings are chosen on this criterion, never
on the retrieval probes. A conversion can keep the first few hundred positions and lose the later ones (or the other
way round); a mean over all positions would let the longer span outvote the short one, so the two are kept apart:
    short   positions < SHORT (256, the default calibration window)
    long    positions >= LONG (1,024)
and the bins in between for the curve.
"""

from __future__ import annotations

import torch

SHORT, LONG = 256, 1024
BINS = (256, 512, 1024, 2048)  # bin edges of the curve (those below the sample length are used)


@torch.no_grad()
def token_kl(model, source, windows: torch.Tensor) -> torch.Tensor:
    """KL(source || model) of each next-token prediction, [n, T] for windows [n, T] (one window per forward, so a
    long window's logits [T, vocab] are the largest tensor held). source: the source model, or its log-softmax
    [n, T, vocab] on these windows (`source_log_probs`, computed once for many models)."""
    kls = []
    for i, w in enumerate(windows):
        p = source[i] if isinstance(source, torch.Tensor) else source_log_probs(source, w[None])[0]
        q = model(w[None]).logits[0].float().log_softmax(-1)
        kls.append((p.exp() * (p - q)).sum(-1))
    return torch.stack(kls)


@torch.no_grad()
def source_log_probs(source, windows: torch.Tensor) -> torch.Tensor:
    """The source's next-token log-probabilities [n, T, vocab] (fp32) on windows [n, T]."""
    return torch.cat([source(w[None]).logits.float().log_softmax(-1) for w in windows])


def position_kl(kl: torch.Tensor, bins: tuple[int, ...] = BINS) -> dict[str, float]:
    """Mean KL in position bins ("0-255", ..., "2048-T-1"), plus "short" (< SHORT), "long" (>= LONG, when the
    windows reach it) and "all"; kl [n, T] from token_kl."""
    length = kl.shape[1]
    edges = (0, *[b for b in bins if b < length], length)
    out = {f"{lo}-{hi - 1}": float(kl[:, lo:hi].mean()) for lo, hi in zip(edges, edges[1:])}
    out["short"] = float(kl[:, :SHORT].mean())
    if length > LONG:
        out["long"] = float(kl[:, LONG:].mean())
    out["all"] = float(kl.mean())
    return out


def long_context_kl(model, source, windows: torch.Tensor, bins: tuple[int, ...] = BINS) -> dict[str, float]:
    """position_kl(token_kl(model, source, windows)): the criterion of the module docstring."""
    return position_kl(token_kl(model, source, windows), bins)
