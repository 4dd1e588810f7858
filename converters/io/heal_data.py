"""Retrieval-aware healing data: windows that ask for something read far back, with the positions that ask for it.

Natural text rarely needs a token from thousands of positions back, so distillation on it cannot teach a compressed
KV cache to keep such tokens. Each window here is `length` tokens cut from the calibration token stream, of one kind:

    repeat  ... S G S ...: a segment S of SEGMENT tokens, the G tokens of text that follow it, then S again; the gap
            G is drawn uniformly from MIN_GAP to what the window holds, so distances spread evenly up to `length`
            (about half the repeats ask past half the window: far distances are trained as often as near ones).
            Weighted: the positions that predict S's tokens 2.. of the second copy (each lies |S| + G tokens after
            the token it copies).
    facts   FACTS sentences "<name>'s <thing> number is <6 digits>." spliced into the text at random positions, then
            each asked again at the end in another order ("<name>'s <thing> number is"): names and digits, the
            shape of a key-value recall; the facts sit uniformly in the text, so their distances spread over the
            window. Weighted: the positions that predict the digits and the full stop.
    plain   the text as it is, every position weighted: short context must not regress.

The weights [n, length - 1] say which predicted positions the KL counts (position t predicts token t + 1); the loss
is sum(w KL) / sum(w) over a batch. Everything is drawn from `seed`, and the texts are only the calibration stream's
own tokens plus the fact sentences: no evaluation text enters.

Held-in windows (`held_in_windows`) select the healed state, so they ask for what is hardest: repeats whose gap lies
in the far half of what the window holds, facts told in the first half of the text and asked at the end, and plain
text; each window's weights sum to 1, so every window counts the same in the criterion (a plain window's 1,023
positions would otherwise outvote a repeat's ~80).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KINDS = ("repeat", "facts", "plain")
MIX = {"repeat": 0.5, "facts": 0.25, "plain": 0.25}  # shares of the windows of each kind (module docstring)
SEGMENT = (32, 128)  # tokens of a repeated segment, drawn uniformly
MIN_GAP = 64  # the shortest gap between the copies: nearer ones need no long-range retrieval
MIN_LENGTH = 2 * SEGMENT[1] + 2 * MIN_GAP  # the shortest window every kind fits in
FACTS = 4  # fact sentences per facts window
NAMES = (
    "Amara",
    "Bruno",
    "Chen",
    "Dalia",
    "Emil",
    "Farah",
    "Goran",
    "Hana",
    "Ivo",
    "Jun",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Oskar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wren",
    "Yusuf",
    "Zoe",
)
THINGS = ("locker", "ticket", "room", "badge", "account", "order", "seat", "parcel")


@dataclass
class WeightedWindows:
    """ids [n, L] token windows; weights [n, L - 1]: the KL's weight at each predicted position."""

    ids: torch.Tensor
    weights: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)


def retrieval_windows(
    stream: torch.Tensor, tokenizer, count: int, length: int, seed: int = 0, mix: dict[str, float] | None = None
) -> WeightedWindows:
    """`count` windows of `length` tokens drawn from the token stream [T] (module docstring), kinds in the shares of
    `mix` (default MIX), in a seeded random order."""
    mix = MIX if mix is None else mix
    _check(count, mix, length, stream)
    gen = torch.Generator().manual_seed(seed)
    return _windows(stream, tokenizer, _kinds(count, mix, gen), length, gen)


def held_in_windows(stream: torch.Tensor, tokenizer, count: int, length: int, seed: int = 0) -> WeightedWindows:
    """`count` held-in windows of `length` tokens from the token stream [T] (module docstring): far repeats, far
    facts and plain text in turn (two repeats to each of the others), each window's weights summing to 1."""
    _check(count, MIX, length, stream)
    cycle = ("repeat", "facts", "repeat", "plain")
    kinds = [cycle[i % len(cycle)] for i in range(count)]
    windows = _windows(stream, tokenizer, kinds, length, torch.Generator().manual_seed(seed), far=True)
    windows.weights /= windows.weights.sum(1, keepdim=True)
    return windows


def _check(count: int, mix: dict[str, float], length: int, stream: torch.Tensor) -> None:
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count={count!r} must be a positive integer")
    if set(mix) - set(KINDS) or not all(v >= 0 for v in mix.values()) or not sum(mix.values()) > 0:
        raise ValueError(f"mix={mix!r} must give non-negative shares of {KINDS}")
    if not isinstance(length, int) or length < MIN_LENGTH:
        raise ValueError(f"heal_len={length!r}: retrieval windows need at least {MIN_LENGTH} tokens")
    if len(stream) < length + 1:
        raise ValueError(f"the calibration text has {len(stream)} tokens, fewer than one window of {length}")


def _windows(stream, tokenizer, kinds: list[str], length: int, gen: torch.Generator, far: bool = False):
    """WeightedWindows: one window of each kind in `kinds`, in turn, drawn from `gen`; far: the held-in shapes."""
    build = {"repeat": _repeat, "facts": _facts, "plain": _plain}
    rows = [build[kind](stream, tokenizer, length, gen, far) for kind in kinds]
    return WeightedWindows(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))


def _kinds(count: int, mix: dict[str, float], gen: torch.Generator) -> list[str]:
    """count kinds in the shares of mix (largest remainders), shuffled."""
    total = sum(mix.values())
    exact = {k: count * v / total for k, v in mix.items()}
    counts = {k: math.floor(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[: count - sum(counts.values())]:
        counts[k] += 1
    kinds = [k for k in KINDS if k in counts for _ in range(counts[k])]
    return [kinds[i] for i in torch.randperm(count, generator=gen).tolist()]


def _text(stream: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """`size` consecutive tokens of the stream from a random start."""
    start = int(torch.randint(0, len(stream) - size + 1, (1,), generator=gen))
    return stream[start : start + size]


def _plain(stream, tokenizer, length, gen, far):
    return _text(stream, length, gen), torch.ones(length - 1)


def _repeat(stream, tokenizer, length, gen, far):
    """prefix + S + G + S + tail from one stretch of text (G: the text after S, so nothing but S repeats); G uniform
    in MIN_GAP..most, far: in the far half of that range."""
    segment = int(torch.randint(SEGMENT[0], SEGMENT[1] + 1, (1,), generator=gen))
    most = length - 2 * segment
    least = (MIN_GAP + most) // 2 if far else MIN_GAP
    gap = int(torch.randint(least, most + 1, (1,), generator=gen))
    prefix = int(torch.randint(0, most - gap + 1, (1,), generator=gen))
    text = _text(stream, length - segment, gen)  # prefix, S, G and the tail, in reading order
    first = prefix + segment + gap  # where the second copy starts
    ids = torch.cat((text[:first], text[prefix : prefix + segment], text[first:]))
    weights = torch.zeros(length - 1)
    weights[first : first + segment - 1] = 1.0  # position t predicts ids[t + 1]: the copy's tokens 2..segment
    return ids, weights


def _facts(stream, tokenizer, length, gen, far):
    """FACTS fact sentences spliced into text at random token positions (far: in its first half), then each
    recalled at the end."""
    names = torch.randperm(len(NAMES), generator=gen)[:FACTS].tolist()
    facts = []
    for n in names:
        thing = THINGS[int(torch.randint(0, len(THINGS), (1,), generator=gen))]
        digits = "".join(str(int(d)) for d in torch.randint(0, 10, (6,), generator=gen))
        key = _tokens(tokenizer, f" {NAMES[n]}'s {thing} number is")
        facts.append((key, _tokens(tokenizer, f" {digits}.")))
    questions = [facts[i] for i in torch.randperm(FACTS, generator=gen).tolist()]
    asked = sum(len(k) + len(v) for k, v in questions)
    told = sum(len(k) + len(v) for k, v in facts)
    text = _text(stream, length - asked - told, gen)
    span = len(text) // 2 if far else len(text)
    cuts = sorted(torch.randint(0, span + 1, (FACTS,), generator=gen).tolist())  # distances up to the window
    pieces, last = [], 0
    for cut, (key, value) in zip(cuts, facts):
        pieces += [text[last:cut], key, value]
        last = cut
    pieces.append(text[last:])
    weights = torch.zeros(length - 1)
    position = length - asked
    for key, value in questions:
        pieces += [key, value]
        position += len(key)
        weights[position - 1 : position - 1 + len(value)] = 1.0  # the positions predicting the value's tokens
        position += len(value)
    return torch.cat(pieces), weights


def _tokens(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)
