"""The held-in long-context criterion: KL(source || converted) per token on long samples of the source itself, by
position, with short and long positions reported apart.

Samples come from the source (calibration.teacher_windows on prompts after the calibration windows), so they are
held-in text of the source's own distribution, never evaluation text: settings are chosen on this criterion, never
on the retrieval probes. A conversion can keep the first few hundred positions and lose the later ones (or the other
way round); a mean over all positions would let the longer span outvote the short one, so the two are kept apart:
    short   positions < SHORT (256, the default calibration window)
    long    positions >= LONG (1,024)
and the bins in between for the curve.

Beside it, the held-in retrieval criterion (`repeat_kl`): KL(source || model) on text the model has seen D tokens
earlier, which is what a low-rank KV cache loses first and a mean over positions hides. An item is S + F + S:
    S   SEGMENT (64) consecutive tokens of held-in text (calibration text or teacher samples, never evaluation text)
    F   the D - SEGMENT tokens of that text which follow S, so the second copy starts D tokens after the first starts:
        each of its tokens lies exactly D tokens after its copy (the copy probe's distance, evaluation/retrieval.py)
scored on the second copy's tokens 2..SEGMENT (the first follows F, not S): SEGMENT - 1 predictions per item, at
distances DISTANCES (256 ... 4,096) by default; "repeat_long" is the mean over D >= LONG.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

SHORT, LONG = 256, 1024
BINS = (256, 512, 1024, 2048)  # bin edges of the curve (those below the sample length are used)
DISTANCES = (256, 512, 1024, 2048, 4096)  # D of the retrieval criterion: second copy's start - first copy's start
SEGMENT = 64  # tokens of the repeated segment S


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


@dataclass
class RepeatItems:
    """Items S + F + S of the retrieval criterion (module docstring): windows[D] [items, D + segment] token ids.
    Scored: the tokens at positions D + 1 .. D + segment - 1 (`targets(D)`), predicted from the positions before."""

    windows: dict[int, torch.Tensor]
    segment: int

    def targets(self, distance: int) -> range:
        """Positions of the scored tokens of the items at `distance`: the second copy's tokens 2..segment."""
        return range(distance + 1, distance + self.segment)

    def __len__(self) -> int:
        return sum(len(w) for w in self.windows.values())


def repeat_items(
    held_in: torch.Tensor, distances: tuple[int, ...] = DISTANCES, items: int = 4, segment: int = SEGMENT, seed: int = 0
) -> RepeatItems:
    """`items` items S + F + S per distance D, cut at random offsets from held-in token ids: a stream [T] (an item
    anywhere in it) or windows [n, L] such as teacher samples (an item inside one window, chosen at random). Each
    distance draws from its own generator, seeded from (seed, D): the same items every run, for every model, and
    adding a distance leaves the others' items as they were."""
    for name, value, least in (("items", items, 1), ("segment", segment, 2)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}={value!r} must be an integer >= {least}")
    if not distances or len(set(distances)) != len(distances):
        raise ValueError(f"distances={list(distances)!r} must be non-empty and distinct")
    bad = [d for d in distances if not isinstance(d, int) or isinstance(d, bool) or d < segment]
    if bad:
        raise ValueError(f"distances {bad}: each must be an integer >= segment={segment} (the copies may not overlap)")
    if held_in.dim() not in (1, 2) or held_in.is_floating_point():
        raise ValueError(
            f"held_in: token ids [T] or windows [n, L] expected, got {held_in.dtype} {tuple(held_in.shape)}"
        )
    rows = held_in[None] if held_in.dim() == 1 else held_in
    windows = {}
    for d in distances:
        span = d + segment
        if rows.shape[1] < span:
            raise ValueError(
                f"distance {d}: an item holds D + segment = {span} tokens, more than the held-in "
                f"{'text' if held_in.dim() == 1 else 'windows'} of {rows.shape[1]} tokens"
            )
        gen = torch.Generator().manual_seed(seed * 1_000_003 + d)
        which = torch.randint(0, len(rows), (items,), generator=gen).tolist()
        starts = torch.randint(0, rows.shape[1] - span + 1, (items,), generator=gen).tolist()
        # S + F: the span's first d tokens (S and the text after it); then S again
        windows[d] = torch.stack(
            [torch.cat([rows[r, s : s + d], rows[r, s : s + segment]]) for r, s in zip(which, starts)]
        )
    return RepeatItems(windows, segment)


@torch.no_grad()
def _scored_log_probs(model, window: torch.Tensor, segment: int) -> torch.Tensor:
    """log-softmax [segment - 1, vocab] (fp32) of model's predictions of the last segment - 1 tokens of window [L]:
    one forward over window[:-1] (the last token predicts nothing scored), the LM head on those positions only."""
    ids = window[None, :-1].to(next(model.parameters()).device)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        logits = model(ids, logits_to_keep=segment - 1).logits[0]
    else:
        logits = model(ids).logits[0, -(segment - 1) :]
    return logits.float().log_softmax(-1).cpu()


@torch.no_grad()
def repeat_source_log_probs(source, items: RepeatItems) -> torch.Tensor:
    """The source's log-probabilities [len(items), segment - 1, vocab] (fp32) on the scored tokens, the items of
    each distance in turn (as items.windows lists them): what repeat_kl needs of the source, computed once."""
    return torch.stack([_scored_log_probs(source, w, items.segment) for ws in items.windows.values() for w in ws])


@torch.no_grad()
def repeat_token_kl(model, source, items: RepeatItems) -> dict[int, torch.Tensor]:
    """D -> KL(source || model) [items, segment - 1] of each scored prediction: sum_v p_v (log p_v - log q_v), p the
    source's, q the model's. source: the source model, or repeat_source_log_probs(source, items)."""
    if isinstance(source, torch.Tensor) and source.shape[:2] != (len(items), items.segment - 1):
        raise ValueError(
            f"source log-probs {tuple(source.shape)} do not fit the items: expected "
            f"[{len(items)}, {items.segment - 1}, vocab] (repeat_source_log_probs of these items)"
        )
    out, i = {}, 0
    for d, ws in items.windows.items():
        kls = []
        for w in ws:
            p = source[i] if isinstance(source, torch.Tensor) else _scored_log_probs(source, w, items.segment)
            q = _scored_log_probs(model, w, items.segment)
            kls.append((p.exp() * (p - q)).sum(-1))
            i += 1
        out[d] = torch.stack(kls)
    return out


def repeat_kl(model, source, items: RepeatItems) -> dict[str, float]:
    """{"repeat:D": mean KL per scored token at each distance D, "repeat_long": the mean over D >= LONG (when
    there is one), "repeat_all": over all D} from repeat_token_kl (a distance's items weigh equally)."""
    return repeat_summary({d: float(k.mean()) for d, k in repeat_token_kl(model, source, items).items()})


def repeat_summary(kl: dict[int, float]) -> dict[str, float]:
    """repeat_kl's dict from the mean KL at each distance D (measured apart, e.g. one distance at a time)."""
    out = {f"repeat:{d}": v for d, v in kl.items()}
    far = [v for d, v in kl.items() if d >= LONG]
    if far:
        out["repeat_long"] = sum(far) / len(far)
    out["repeat_all"] = sum(kl.values()) / len(kl)
    return out
