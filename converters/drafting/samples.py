"""Teacher samples for training a drafter: the target's own continuations and its last hidden states.

Prompts come from the calibration text's held-in part (the first HELD_IN of it; the rest is left for measuring):
plain continuations of a few tokens of text and, when the tokenizer has a chat template, chat requests that quote a
short span of it. The target continues each at temperature 1, top-p 0.95 (calibration.sample_from_teacher); a
forward hook on its decoder keeps the final hidden state of every position it runs, so no second pass is needed.
"""

from __future__ import annotations

import logging

import torch

from ..io.calibration import TEACHER_PROMPT, sample_from_teacher

logger = logging.getLogger(__name__)

HELD_IN = 0.9  # share of the calibration text prompts are drawn from; the tail is for benchmarks
CHAT_REQUESTS = ("Continue this story: {}", "Tell me what happens next: {}")  # one group (and batch) each
CHAT_SPAN = 12  # tokens of text quoted in a chat request
SAMPLE_BATCH = 128  # rows decoded at once: a step's cost is mostly fixed (SmolLM2-135M, one thread: 1.9x the
# tokens per second of batch 32)


def held_in_ids(text: str, tokenizer) -> torch.Tensor:
    """Token ids of the held-in part of the calibration text."""
    return tokenizer(text[: int(len(text) * HELD_IN)], return_tensors="pt", add_special_tokens=False).input_ids[0]


def chat_frame(tokenizer) -> tuple[list[int], list[int]] | None:
    """(ids before, ids after) a user message in the chat template, or None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\u2063MESSAGE\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    before, _, after = text.partition(marker)
    encode = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    return encode(before), encode(after)


def prompt_groups(ids: torch.Tensor, tokenizer, samples: int, seed: int = 0) -> list[torch.Tensor]:
    """Prompt tensors [n_g, p_g] (equal length within a group): half plain text starts of TEACHER_PROMPT tokens,
    half chat requests (one group per request wording), or all plain without a chat template."""
    generator = torch.Generator().manual_seed(seed)
    frame = chat_frame(tokenizer)
    chat = samples // 2 if frame else 0
    span = max(TEACHER_PROMPT, CHAT_SPAN)
    starts = torch.randint(0, len(ids) - span, (samples,), generator=generator)
    groups = [torch.stack([ids[s : s + TEACHER_PROMPT] for s in starts[chat:].tolist()])]
    if chat:
        before, after = frame
        for i, wording in enumerate(CHAT_REQUESTS):
            mine = starts[:chat][i :: len(CHAT_REQUESTS)].tolist()
            if not mine:
                continue
            head, _, tail = wording.partition("{}")
            head = tokenizer(head, add_special_tokens=False).input_ids if head else []
            rows = [before + head + ids[s : s + CHAT_SPAN].tolist() + after for s in mine]
            groups.append(torch.tensor(rows))
    return groups


@torch.no_grad()
def teacher_samples(
    target, tokenizer, text: str, samples: int, length: int, seed: int = 0, progress: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n, length], hidden [n, length - 1, D]): target samples and its final hidden state h_i at each
    position i < length - 1 (the last token is sampled, never run)."""
    ids = held_in_ids(text, tokenizer)
    if len(ids) < 4 * CHAT_SPAN:
        raise ValueError(f"calibration text: {len(ids)} held-in tokens, too few to draw prompts from")
    groups = prompt_groups(ids, tokenizer, samples, seed)
    longest = max(group.shape[1] for group in groups)
    if longest >= length:
        raise ValueError(f"length={length}: must exceed the longest prompt ({longest} tokens)")
    captured: list[torch.Tensor] = []
    hook = target.get_decoder().register_forward_hook(
        lambda module, args, out: captured.append(
            (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]).float().cpu()
        )
    )
    tokens, hidden = [], []
    try:
        for group in groups:
            captured.clear()
            tokens.append(
                sample_from_teacher(target, group, length, seed=seed, batch_size=SAMPLE_BATCH, progress=progress)
            )
            hidden.append(_stitch(captured, len(group), length))
    finally:
        hook.remove()
    return torch.cat(tokens), torch.cat(hidden)


def _stitch(captured: list[torch.Tensor], rows: int, length: int) -> torch.Tensor:
    """Hook outputs in call order -> [rows, length - 1, D]. sample_from_teacher runs batches of rows in turn, each a
    prefill [b, p, D] then one [b, 1, D] per new token but the last: a batch's widths add up to length - 1."""
    batches, current, width = [], [], 0
    for out in captured:
        current.append(out)
        width += out.shape[1]
        if width == length - 1:
            batches.append(torch.cat(current, dim=1))
            current, width = [], 0
    result = torch.cat(batches)
    if result.shape[0] != rows:
        raise RuntimeError(f"teacher samples: captured hidden states of {result.shape[0]} rows, expected {rows}")
    return result
