"""The model runner: one packed forward per engine step over the paged KV memory.

    runner = ModelRunner(model, kv)
    logits = runner.forward(scheduled)   # scheduled: [(request, n tokens)] -> float32 logits [sum(1 + drafts), V]

The scheduled tokens of many requests go through the model as one row [1, T] with their own position ids; each
layer reads its requests' contexts from the paged storage by the step's plan.
"""

from __future__ import annotations

import contextlib

import torch

from .attention import ENGINE_ATTENTION
from .kv import EngineKV, StepPlan

DECODE_GROUP = 16  # decodes per batched attention call: sorted by context length, each group padded to its longest


class ModelRunner:
    def __init__(self, model, kv: EngineKV):
        self.model, self.kv = model, kv
        self.device = next(model.parameters()).device

    def forward(self, scheduled, keep: list[int] | None = None) -> torch.Tensor:
        """Packed forward of the scheduled tokens -> float32 logits [sum(1 + drafts), V] on the CPU: per request
        that reaches its end (request.remaining == n), its last token's and (speculation) every draft position's.
        keep: instead, the indices into the step's packed tokens (scheduled order) whose logits to return."""
        tokens, positions, slots, decode, chunks, last = [], [], [], [], [], []
        for request, n in scheduled:
            start = len(tokens)
            tokens += (request.tokens + request.draft)[request.computed : request.computed + n]
            positions += range(request.computed, request.computed + n)
            context = self.kv.slots(request.table, 0, request.computed + n)
            slots.append(context[request.computed :])  # where this step's tokens are written
            if n == 1:
                decode.append((start, context))
            else:
                chunks.append((start, n, context))
            if request.remaining == n:  # logits of its last token, and of each draft position before it
                last.extend(range(len(tokens) - 1 - len(request.draft), len(tokens)))
        device = self.device
        self.kv.plan = StepPlan(
            slot_mapping=torch.cat(slots).to(device),
            decode_groups=_decode_groups(decode, device),
            chunks=[(s, n, c.to(device)) for s, n, c in chunks],
        )
        keep = torch.tensor(last if keep is None else keep, dtype=torch.long, device=device)
        with torch.no_grad(), _attention(self.model, ENGINE_ATTENTION):
            out = self.model(input_ids=torch.tensor([tokens], device=device),
                             position_ids=torch.tensor([positions], device=device), past_key_values=self.kv,
                             use_cache=True, logits_to_keep=keep)  # fmt: skip
        self.kv.plan = None
        return out.logits[0].float().cpu()


def _decode_groups(decode: list[tuple[int, torch.Tensor]], device) -> list:
    """[(token index, context slots)] -> [(token indices [g], slots [g, Lmax], lengths [g])] by context length."""
    decode = sorted(decode, key=lambda item: item[1].numel())
    groups = []
    for start in range(0, len(decode), DECODE_GROUP):
        group = decode[start : start + DECODE_GROUP]
        slots = torch.zeros((len(group), group[-1][1].numel()), dtype=torch.long)
        for i, (_, context) in enumerate(group):
            slots[i, : context.numel()] = context
        groups.append((torch.tensor([t for t, _ in group], dtype=torch.long, device=device), slots.to(device),
                       torch.tensor([c.numel() for _, c in group], dtype=torch.long, device=device)))  # fmt: skip
    return groups


@contextlib.contextmanager
def _attention(model, name: str):
    """Run the model with attention implementation `name`, restoring the user's afterwards."""
    configs = [c for c in (model.config, model.config.get_text_config(decoder=True)) if c is not None]
    saved = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = name
    try:
        yield
    finally:
        for c, value in zip(configs, saved):
            c._attn_implementation = value
