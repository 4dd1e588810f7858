"""Context retrieval: can the model use a token it saw `distance` tokens ago? Synthetic, no data beyond the model's
own vocabulary, scored by greedy (argmax) next-token predictions in one forward pass per batch.

Tasks (distance d: from the token that holds the answer to the position that must reproduce it):
    passkey    "The pass key is 48213. Remember it." + repeated filler sentences + "What is the pass key? The pass key
               is" -> the 5 digits; an item counts when every key token is predicted (exact match).
    copy       a random segment S of d vocabulary tokens, then S again: the share of S's tokens 2..d predicted in the
               second copy (each lies d tokens after the token it copies).
    induction  random vocabulary tokens holding "A B" once, and A again d tokens after the first A -> B (exact match).

Random tokens come from the source's own vocabulary (`known_vocabulary`: the pieces it writes when sampling), so
no data is needed. Perplexity averages over every position, where the last few hundred tokens usually suffice;
these scores move only when attention finds one sharp position far back, which a low-rank KV cache can lose first.
Small story models (stories260k, stories15M) score near zero on random tokens: they copy their own kind of text
(mostly from their prior), not arbitrary tokens, so their figures are checks of the machinery, not of retrieval.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

TASKS = ("passkey", "copy", "induction")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = ("The pass key is", ". Remember it.")
QUERY = " What is the pass key? The pass key is"
PREFIX = 16  # filler / random tokens before the needle, so that it never sits at the first positions
MAX_BATCH_TOKENS = 16384  # tokens per forward pass (batch x length): bounds the activations of long distances


@dataclass
class Batch:
    """Token ids [n, L]; `targets` [n, L] True where the token must be predicted from the positions before it;
    `exact`: an item counts only when all its targets are right (else: the share of targets right)."""

    ids: torch.Tensor
    targets: torch.Tensor
    exact: bool


@dataclass
class RetrievalResult:
    """accuracy[task][distance] in [0, 1]; items per (task, distance)."""

    accuracy: dict[str, dict[int, float]]
    items: int
    context: int
    extra: dict = field(default_factory=dict)

    def mean(self, task: str | None = None) -> float:
        """Mean over distances (of one task, or of all tasks' means)."""
        if task is not None:
            values = list(self.accuracy[task].values())
            return sum(values) / len(values)
        return sum(self.mean(t) for t in self.accuracy) / len(self.accuracy)

    def to_dict(self) -> dict:
        return {
            "items": self.items,
            "context": self.context,
            "mean": round(self.mean(), 4),
            "accuracy": {t: {str(d): round(a, 4) for d, a in acc.items()} for t, acc in self.accuracy.items()},
        }

    @classmethod
    def from_dict(cls, data: dict) -> RetrievalResult:
        """The result `to_dict` wrote (accuracies as rounded there)."""
        accuracy = {t: {int(d): a for d, a in acc.items()} for t, acc in data["accuracy"].items()}
        return cls(accuracy, data["items"], data["context"])


def vocabulary(tokenizer) -> torch.Tensor:
    """Ids of the tokenizer's ordinary pieces: not special, not byte-fallback (<0x..>), not blank, no digits (the
    passkey's answer is digits), no sentence punctuation (random segments read as one long run-on text)."""
    special = set(tokenizer.all_special_ids)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    keep = [
        i
        for i, p in enumerate(pieces)
        if i not in special
        and p is not None
        and not re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", p)
        and tokenizer.decode([i]).strip()
        and not re.search(r"[0-9.?!<>]", p)
    ]
    if len(keep) < 16:
        raise ValueError(f"the tokenizer has {len(keep)} ordinary tokens: too few for random segments")
    return torch.tensor(keep)


@torch.no_grad()
def known_vocabulary(model, tokenizer, samples: int = 8, length: int = 128, seed: int = 0) -> torch.Tensor:
    """The ordinary tokens (`vocabulary`) that the model itself writes: distinct tokens of `samples` continuations of
    `length` tokens sampled at temperature 1 from the start of a text (bos, or the filler's first token). A small
    model has never seen most of a large tokenizer's pieces and cannot copy them; its own samples hold the ones it
    knows. Pass the source's to every conversion so that all answer the same items."""
    ordinary = vocabulary(tokenizer)
    start = _bos(tokenizer) or _encode(tokenizer, FILLER)[:1]
    device = next(model.parameters()).device
    pad = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0, 1) if i is not None and i != start[-1])
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        prompt = torch.tensor([start] * samples, device=device)
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=length,
            min_new_tokens=length,
            pad_token_id=pad,
        )
    seen = torch.unique(out[:, len(start) :].cpu())
    known = ordinary[torch.isin(ordinary, seen)]
    if len(known) < 16:
        raise ValueError(f"the model wrote {len(known)} distinct ordinary tokens in {samples} x {length}: too few")
    return known


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def passkey_batch(tokenizer, distance: int, items: int, gen: torch.Generator) -> Batch:
    """`items` passkey prompts whose key sits `distance` tokens before its repetition in the answer."""
    filler = _encode(tokenizer, FILLER) * 2
    head, tail, query = _encode(tokenizer, NEEDLE[0]), _encode(tokenizer, NEEDLE[1]), _encode(tokenizer, QUERY)
    rows, masks = [], []
    for _ in range(items):
        key = _encode(tokenizer, " " + "".join(str(int(d)) for d in torch.randint(0, 10, (5,), generator=gen)))
        gap = distance - len(key) - len(tail) - len(query)  # filler between the needle and the question
        if gap < 0:
            raise ValueError(f"distance={distance} is shorter than the passkey's own text ({distance - gap} tokens)")
        cycle = filler[int(torch.randint(0, len(filler) // 2, (1,), generator=gen)) :]
        repeat = (cycle * (1 + (PREFIX + gap) // len(cycle)))[: PREFIX + gap]
        prefix = _bos(tokenizer) + repeat[:PREFIX] + head
        row = prefix + key + tail + repeat[PREFIX:] + query + key
        rows.append(row)
        masks.append([False] * (len(row) - len(key)) + [True] * len(key))
    return right_aligned(rows, masks)  # keys of different token counts


def right_aligned(rows: list[list[int]], masks: list[list[bool]]) -> Batch:
    """An exact-match Batch of rows of token ids and their target masks, shorter rows left-filled with their first
    token (never a target), so every row ends where its answer ends and no padding lies inside a row."""
    width = max(len(r) for r in rows)
    rows = [r[:1] * (width - len(r)) + r for r in rows]
    masks = [[False] * (width - len(m)) + m for m in masks]
    return Batch(torch.tensor(rows), torch.tensor(masks), exact=True)


def copy_batch(vocab: torch.Tensor, distance: int, items: int, gen: torch.Generator, bos: list[int]) -> Batch:
    """Random segments of `distance` tokens, each followed by itself; targets: the second copy but its first token."""
    segment = vocab[torch.randint(0, len(vocab), (items, distance), generator=gen)]
    ids = torch.cat([torch.tensor([bos] * items, dtype=torch.long).reshape(items, len(bos)), segment, segment], 1)
    targets = torch.zeros_like(ids, dtype=torch.bool)
    targets[:, len(bos) + distance + 1 :] = True
    return Batch(ids, targets, exact=False)


def induction_batch(vocab: torch.Tensor, distance: int, items: int, gen: torch.Generator, bos: list[int]) -> Batch:
    """Random tokens with "A B" after PREFIX tokens and A again `distance` tokens after the first A; target: B."""
    length = len(bos) + PREFIX + distance + 2
    rows = []
    for _ in range(items):
        a, b = vocab[torch.randperm(len(vocab), generator=gen)[:2]].tolist()
        pool = vocab[(vocab != a) & (vocab != b)]
        row = bos + pool[torch.randint(0, len(pool), (length - len(bos),), generator=gen)].tolist()
        first = len(bos) + PREFIX
        row[first], row[first + 1], row[first + distance], row[first + distance + 1] = a, b, a, b
        rows.append(row)
    ids = torch.tensor(rows)
    targets = torch.zeros_like(ids, dtype=torch.bool)
    targets[:, -1] = True
    return Batch(ids, targets, exact=True)


def overhead(tokenizer, task: str) -> int:
    """Tokens of an item beyond `distance` (so distance + overhead <= the context)."""
    bos = len(_bos(tokenizer))
    if task == "copy":
        return bos  # and `distance` once more: copy items are bos + 2 x distance long
    if task == "induction":
        return bos + PREFIX + 2
    key = len(_encode(tokenizer, " 00000"))
    return bos + PREFIX + len(_encode(tokenizer, NEEDLE[0])) + 2 * key  # rows differ by at most a token: +key margin


def distances(tokenizer, context: int, task: str, smallest: int = 16, largest: int | None = None) -> list[int]:
    """Powers of two from `smallest`, then the longest distance whose item fits in `context` (or `largest`)."""
    top = (context - overhead(tokenizer, task)) // (2 if task == "copy" else 1)
    if task == "passkey":
        floor = len(_encode(tokenizer, " 00000")) + len(_encode(tokenizer, NEEDLE[1])) + len(_encode(tokenizer, QUERY))
        smallest = max(smallest, 1 << (floor - 1).bit_length())
    top = min(top, largest) if largest is not None else top
    grid = [d for d in (smallest << i for i in range(32)) if d < top]
    return grid + [top] if top >= smallest else grid


def make_batch(task: str, tokenizer, vocab: torch.Tensor, distance: int, items: int, gen: torch.Generator) -> Batch:
    if task == "passkey":
        return passkey_batch(tokenizer, distance, items, gen)
    if task == "copy":
        return copy_batch(vocab, distance, items, gen, _bos(tokenizer))
    if task == "induction":
        return induction_batch(vocab, distance, items, gen, _bos(tokenizer))
    raise ValueError(f"task={task!r} is not one of {TASKS}")


@torch.no_grad()
def score(model, batch: Batch) -> float:
    """Accuracy of the greedy predictions at `batch.targets` (exact match per item, or the share of tokens).
    Logits only at the predicting positions: a full [n, L, vocab] tensor would dominate the memory at long L."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    device = next(model.parameters()).device
    n, length = batch.ids.shape
    chunk = max(1, MAX_BATCH_TOKENS // length)
    right, counted = 0.0, 0
    for start in range(0, n, chunk):
        ids, targets = batch.ids[start : start + chunk].to(device), batch.targets[start : start + chunk].to(device)
        hidden = decoder(input_ids=ids).last_hidden_state  # [b, L, hidden]
        before = torch.zeros_like(targets)
        before[:, :-1] = targets[:, 1:]  # the position before each target predicts it
        predicted = head(hidden[before]).argmax(-1)  # [targets], row-major like ids[targets]
        hit = (predicted == ids[targets]).float()
        if batch.exact:
            per_item = targets.sum(1).tolist()
            right += sum(float(h.all()) for h in hit.split(per_item))
            counted += len(per_item)
        else:
            right += float(hit.sum())
            counted += hit.numel()
    return right / counted


def evaluate_retrieval(
    model,
    tokenizer,
    tasks: tuple[str, ...] = TASKS,
    items: int = 16,
    seed: int = 0,
    context: int | None = None,
    smallest: int = 16,
    largest: int | None = None,
    vocab: torch.Tensor | None = None,
) -> RetrievalResult:
    """accuracy[task][distance] for distances `distances(...)` up to the model's context (max_position_embeddings,
    or `context`; `largest` caps them). Random tokens come from `vocab` (default: `known_vocabulary(model)`): with
    the source's vocab and the same seed, a conversion answers exactly the source's items."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks={list(tasks)!r}: each must be one of {TASKS}")
    if not isinstance(items, int) or isinstance(items, bool) or items < 1:
        raise ValueError(f"items={items!r} must be a positive integer")
    context = context or model.config.max_position_embeddings
    grids = {task: distances(tokenizer, context, task, smallest, largest) for task in tasks}
    empty = [task for task, grid in grids.items() if not grid]
    if empty:  # refused before any work: a task with no distance has no accuracy to average
        raise ValueError(
            f"smallest={smallest}, largest={largest}: no distance of {empty} fits (context {context}; "
            "a passkey item needs at least its needle and question)"
        )
    vocab = known_vocabulary(model, tokenizer, seed=seed) if vocab is None else vocab
    was_training = model.training
    model.eval()
    accuracy = {}
    try:
        for t, task in enumerate(tasks):
            accuracy[task] = {}
            for d in grids[task]:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + t * 100_003 + d)
                accuracy[task][d] = score(model, make_batch(task, tokenizer, vocab, d, items, gen))
                logger.info("retrieval %s d=%d: %.3f", task, d, accuracy[task][d])
    finally:
        model.train(was_training)
    return RetrievalResult(accuracy, items, context, {"vocab": len(vocab)})


def retained(result: RetrievalResult, source: RetrievalResult) -> dict[str, dict[int, float | None]]:
    """Per task and distance: the conversion's accuracy over the source's (None where the source scores 0)."""
    return {
        task: {d: (a / source.accuracy[task][d] if source.accuracy[task][d] else None) for d, a in acc.items()}
        for task, acc in result.accuracy.items()
    }


def table(results: dict[str, RetrievalResult]) -> str:
    """A markdown table: one row per model, one column per (task, distance), then the mean."""
    first = next(iter(results.values()))
    columns = [(t, d) for t, acc in first.accuracy.items() for d in acc]
    lines = [
        "| model | " + " | ".join(f"{t} {d}" for t, d in columns) + " | mean |",
        "|---|" + "---:|" * (len(columns) + 1),
    ]
    for name, r in results.items():
        cells = (f"{r.accuracy[t][d]:.2f}" if d in r.accuracy.get(t, {}) else "-" for t, d in columns)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r.mean():.3f} |")
    return "\n".join(lines)
