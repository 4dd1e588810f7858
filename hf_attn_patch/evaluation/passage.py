"""Repeated-passage retrieval on real text: can the model copy a passage it read `gap` tokens ago?

An item is bos + P + G + P: P a passage of `passage` consecutive tokens of an evaluation text, G the `gap` tokens of
that text which follow P (other text, never a repeat of P), then P again. The score is the share of the second
copy's tokens 2..passage that the greedy (argmax) next-token prediction gets right: each lies passage + gap tokens
after the token it copies. Unlike the synthetic copy probe (random vocabulary tokens, retrieval.py), the passage is
ordinary text, so a model may also predict some of it from its prior; the source's own score is the reference.

Items are drawn with a generator seeded from (seed, text name, gap), so the source and every conversion answer the
same items. Results are RetrievalResult objects with one task per text ("passage:wikitext"), accuracy[task][gap].
"""

from __future__ import annotations

import logging

import torch

from .retrieval import Batch, RetrievalResult, score

logger = logging.getLogger(__name__)

GAPS = (200, 1000, 3000)  # D: tokens of other text between the two copies
PASSAGE = 128  # tokens of the repeated passage


def passage_batch(ids: torch.Tensor, gap: int, items: int, gen: torch.Generator, bos: list[int],
                  passage: int = PASSAGE) -> Batch:  # fmt: skip
    """`items` rows bos + P + G + P cut from the token stream ids [T] at random offsets; targets: the second P but
    its first token (that one follows G, not P)."""
    span = passage + gap
    if len(ids) < span:
        raise ValueError(f"the evaluation text has {len(ids)} tokens, fewer than passage + gap = {span}")
    starts = torch.randint(0, len(ids) - span + 1, (items,), generator=gen).tolist()
    head = torch.tensor(bos, dtype=torch.long)
    rows = [torch.cat([head, ids[s : s + span], ids[s : s + passage]]) for s in starts]
    batch = torch.stack(rows)  # [items, len(bos) + 2 passage + gap]
    targets = torch.zeros_like(batch, dtype=torch.bool)
    targets[:, len(bos) + span + 1 :] = True
    return Batch(batch, targets, exact=False)


def evaluate_passages(model, tokenizer, texts: dict[str, str], gaps: tuple[int, ...] = GAPS, items: int = 8,
                      seed: int = 0, passage: int = PASSAGE) -> RetrievalResult:  # fmt: skip
    """accuracy["passage:<name>"][gap] for each evaluation text (name -> text) and gap (module docstring)."""
    if not isinstance(items, int) or isinstance(items, bool) or items < 1:
        raise ValueError(f"items={items!r} must be a positive integer")
    if not texts or any(not isinstance(g, int) or g < 1 for g in gaps) or not gaps:
        raise ValueError(f"texts ({list(texts)}) and gaps ({list(gaps)}) must be non-empty, gaps positive integers")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    context = model.config.max_position_embeddings
    longest = len(bos) + 2 * passage + max(gaps)
    if longest > context:
        raise ValueError(f"gap {max(gaps)}: an item holds {longest} tokens, over the model's context of {context}")
    was_training = model.training
    model.eval()
    accuracy: dict[str, dict[int, float]] = {}
    try:
        for t, (name, text) in enumerate(texts.items()):
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
            task = f"passage:{name}"
            accuracy[task] = {}
            for gap in gaps:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + t * 100_003 + gap)
                accuracy[task][gap] = score(model, passage_batch(ids, gap, items, gen, bos, passage))
                logger.info("retrieval %s D=%d: %.3f", task, gap, accuracy[task][gap])
    finally:
        model.train(was_training)
    return RetrievalResult(accuracy, items, context, {"passage": passage})
