"""Retrieval on real text: can the model copy a passage, or recall a fact, that it read `gap` tokens ago?

An item is bos + P + G + P: P a passage of `passage` consecutive tokens of an evaluation text, G the `gap` tokens of
that text which follow P (other text, never a repeat of P), then P again. The score is the share of the second
copy's tokens 2..passage that the greedy (argmax) next-token prediction gets right: each lies passage + gap tokens
after the token it copies. Unlike the synthetic copy probe (random vocabulary tokens, retrieval.py), the passage is
ordinary text, so a model may also predict some of it from its prior; the source's own score is the reference.

A fact item is bos + T + F + G + Q + V: T a few tokens of the text, F a fact sentence "The code of the <colour>
<object> is <5 digits>." (Q + V), G `gap` tokens of the text, then the question Q "The code of the <colour> <object>
is" and its value V; it counts when every token of V is predicted (exact match). The sentence's words are not those
of converters/io/heal_data.py's facts, so a healed model is not asked what it was trained on.

Items are drawn with a generator seeded from (seed, text name, gap), so the source and every conversion answer the
same items. Results are RetrievalResult objects with one task per text ("passage:wikitext", "facts:wikitext"),
accuracy[task][gap]; `long_context` puts a model beside its source as shares of the source's accuracy.
"""

from __future__ import annotations

import logging

import torch

from .retrieval import Batch, RetrievalResult, right_aligned, score

logger = logging.getLogger(__name__)

GAPS = (200, 1000, 3000)  # D: tokens of other text between the two copies
PASSAGE = 128  # tokens of the repeated passage
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "silver", "golden", "purple", "orange")
OBJECTS = ("door", "box", "gate", "safe", "chest", "car", "boat", "lock", "drawer", "cabinet")
LEAD = 16  # tokens of text before a fact sentence, so it never sits at the first positions


def passage_batch(
    ids: torch.Tensor, gap: int, items: int, gen: torch.Generator, bos: list[int], passage: int = PASSAGE
) -> Batch:
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


def fact_batch(ids: torch.Tensor, tokenizer, gap: int, items: int, gen: torch.Generator, bos: list[int]) -> Batch:
    """`items` rows bos + T + F + G + Q + V (module docstring) cut from the token stream ids [T] at random offsets;
    targets: V's tokens. Rows whose sentences tokenize to other lengths are left-padded with their first token."""
    if len(ids) < LEAD + gap:
        raise ValueError(f"the evaluation text has {len(ids)} tokens, fewer than {LEAD} + gap = {LEAD + gap}")
    rows, masks = [], []
    for _ in range(items):
        colour = COLOURS[int(torch.randint(0, len(COLOURS), (1,), generator=gen))]
        thing = OBJECTS[int(torch.randint(0, len(OBJECTS), (1,), generator=gen))]
        digits = "".join(str(int(d)) for d in torch.randint(0, 10, (5,), generator=gen))
        question = _tokens(tokenizer, f" The code of the {colour} {thing} is")
        value = _tokens(tokenizer, f" {digits}.")
        start = int(torch.randint(0, len(ids) - LEAD - gap + 1, (1,), generator=gen))
        text = ids[start : start + LEAD + gap].tolist()
        row = bos + text[:LEAD] + question + value + text[LEAD:] + question + value
        rows.append(row)
        masks.append([False] * (len(row) - len(value)) + [True] * len(value))
    return right_aligned(rows, masks)


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def evaluate_passages(
    model,
    tokenizer,
    texts: dict[str, str],
    gaps: tuple[int, ...] = GAPS,
    items: int = 8,
    seed: int = 0,
    passage: int = PASSAGE,
    facts: tuple[int, ...] = (),
) -> RetrievalResult:
    """accuracy["passage:<name>"][gap] for each evaluation text (name -> text) and gap, and accuracy["facts:<name>"]
    [gap] for each gap of `facts` (module docstring)."""
    if not isinstance(items, int) or isinstance(items, bool) or items < 1:
        raise ValueError(f"items={items!r} must be a positive integer")
    if not texts or any(not isinstance(g, int) or g < 1 for g in gaps) or not (gaps or facts):
        raise ValueError(
            f"texts ({list(texts)}) and gaps ({list(gaps)}) or facts ({list(facts)}) must be non-empty, "
            "gaps positive integers"
        )
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    context = model.config.max_position_embeddings
    if any(not isinstance(g, int) or g < 1 for g in facts):
        raise ValueError(f"facts={list(facts)!r} must be positive integers")
    longest = len(bos) + 2 * passage + max((*gaps, *facts))  # a fact item is shorter than a passage item
    if longest > context:
        raise ValueError(f"gap {max(gaps)}: an item holds {longest} tokens, over the model's context of {context}")
    was_training = model.training
    model.eval()
    accuracy: dict[str, dict[int, float]] = {}
    try:
        for t, (name, text) in enumerate(texts.items()):
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
            task = f"passage:{name}"
            if gaps:
                accuracy[task] = {}
            for gap in gaps:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + t * 100_003 + gap)
                accuracy[task][gap] = score(model, passage_batch(ids, gap, items, gen, bos, passage))
                logger.info("retrieval %s D=%d: %.3f", task, gap, accuracy[task][gap])
            if facts:
                accuracy[f"facts:{name}"] = {}
            for gap in facts:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + t * 100_003 + gap + 77)
                accuracy[f"facts:{name}"][gap] = score(model, fact_batch(ids, tokenizer, gap, items, gen, bos))
                logger.info("retrieval facts:%s D=%d: %.3f", name, gap, accuracy[f"facts:{name}"][gap])
    finally:
        model.train(was_training)
    return RetrievalResult(accuracy, items, context, {"passage": passage})


LONG_GAPS = (1024, 2048, 4096)  # the distances `hf-attn eval --long-context` asks at (those that fit the context)


def long_context(
    model, reference, tokenizer, text: str, gaps: tuple[int, ...] = LONG_GAPS, items: int = 8, seed: int = 0
) -> dict:
    """The long-context check of a conversion on the user's own text: repeated passages and fact recall at each gap
    that fits the model's context, for the model and its reference (same items), and the model's share of the
    reference's accuracy ("retained", None where the reference scores 0). A JSON-ready dict."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    context = min(model.config.max_position_embeddings, reference.config.max_position_embeddings)
    fitting = tuple(g for g in gaps if len(bos) + 2 * PASSAGE + g <= context)
    if not fitting:
        raise ValueError(
            f"gaps={list(gaps)}: none fits the model's context of {context} tokens (an item holds "
            f"{len(bos) + 2 * PASSAGE} tokens and the gap)"
        )
    tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
    if tokens < PASSAGE + fitting[0]:
        raise ValueError(
            f"the text has {tokens} tokens: a passage of {PASSAGE} and a gap of {fitting[0]} need "
            f"{PASSAGE + fitting[0]}"
        )
    fitting = tuple(g for g in fitting if PASSAGE + g <= tokens)
    texts = {"text": text}
    ours = evaluate_passages(model, tokenizer, texts, fitting, items, seed, facts=fitting)
    theirs = evaluate_passages(reference, tokenizer, texts, fitting, items, seed, facts=fitting)
    out = {"items": items, "gaps": list(fitting)}
    for kind in ("passage", "facts"):
        mine, source = ours.accuracy[f"{kind}:text"], theirs.accuracy[f"{kind}:text"]
        out[kind] = {
            str(g): {
                "accuracy": round(mine[g], 4),
                "source": round(source[g], 4),
                "retained": round(mine[g] / source[g], 4) if source[g] else None,
            }
            for g in fitting
        }
    return out
