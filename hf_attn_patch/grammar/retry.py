"""Retry after a failed exact JSON Schema check (schema_checks.py): roll back, forbid, decode again.

One policy for every caller, :class:`RowRetry` (one per sequence):

    retry = RowRetry()                                   # MAX_RETRIES attempts
    keep = retry.plan(state, max_new_tokens)             # after the state's check failed: tokens to keep, or None
    retry.rewind(state, keep)                            # the state back at `keep`, the failed continuation masked

``plan`` keeps the tokens before the value whose check failed (at least the last token goes) and forbids that last
token after the text before it; None when the attempts are spent or no token of ``max_new_tokens`` would be left.
The engine (engine/output_processor.py) rewinds the request's state, tokens, text and KV in place and decodes on.
generate() cannot take tokens back, so its wrapper (:func:`retry_failed_rows`) does it after the call: each such row
runs again alone from its prompt + the kept tokens (its KV is recomputed: generate() keeps no cache between calls), with
the same options and the tokens left of ``max_new_tokens``. Speculative decoding (assistant_model, prompt lookup, early
exit) is retried the same way: its grammar rows hand their final states back to the processor. A row still failing keeps
its ``check_failed`` end (only EOS after it). Not retried: beams, streamers and dict outputs, whose rows end the same
way but are returned as they are.
"""

from __future__ import annotations

import copy
import logging

import torch

logger = logging.getLogger(__name__)

MAX_RETRIES = 3
_NOT_RETRIED = ("streamer",)


class RowRetry:
    """The retry budget and the forbidden continuations ({text: token ids}) of one sequence."""

    def __init__(self, max_retries: int = MAX_RETRIES):
        self.max_retries = max_retries
        self.retries = 0
        self.forbid: dict[bytes, set[int]] = {}
        self.reason: str | None = None  # the last failure retried ("'not' at #/properties/v")

    def plan(self, state, max_new_tokens: int) -> int | None:
        """After `state` (a GrammarState) ended in a failed check: how many of its tokens to keep, the failing
        continuation recorded as forbidden; None when the budget is spent (attempts, or no token left to decode)."""
        point = state._m.retry_point() if state.retryable else None
        if point is None or self.retries >= self.max_retries or not state.tokens:
            return None
        keep, before_last = point
        keep = min(keep, len(state.tokens) - 1)  # the forbidden token goes at least
        if max_new_tokens - keep <= 0:
            return None
        self.retries += 1
        self.reason = state._m.failed or state._m.last_failure or self.reason
        self.forbid.setdefault(before_last, set()).add(state.tokens[-1])
        return keep

    def rewind(self, state, keep: int) -> None:
        """`state` back at its first `keep` tokens, its attempts renewed and the forbidden continuations masked."""
        state.rollback(len(state.tokens) - keep)
        state._m.restart(self.forbid, self.reason)


def _plain(kwargs: dict, model) -> bool:
    config = kwargs.get("generation_config") or model.generation_config
    if any(kwargs.get(k) is not None for k in _NOT_RETRIED) or kwargs.get("return_dict_in_generate"):
        return False
    if (kwargs.get("num_beams") or getattr(config, "num_beams", 1) or 1) > 1:
        return False
    return not getattr(config, "return_dict_in_generate", False)


def retry_failed_rows(model, original, processor, out, args: tuple, kwargs: dict):
    """`out` (generate()'s [B, T] tensor) with its check_failed rows decoded again (module docstring), and every
    row's finish reason: "eos", "length", or the reason a row still failing gives ("check_failed: ...")."""
    reasons = list(processor.finish_reasons)
    if not torch.is_tensor(out) or processor.prompt_len is None or not _plain(kwargs, model):
        return out, reasons
    failed = [r for r, why in enumerate(reasons) if (why or "").startswith("check_failed")]
    if not failed:
        return out, reasons
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if not torch.is_tensor(inputs) or inputs.dim() != 2:
        return out, reasons
    mask = kwargs.get("attention_mask")
    prompt_len = processor.prompt_len
    per_input = out.shape[0] // inputs.shape[0]
    per_grammar = out.shape[0] // len(processor.grammars)
    max_new = kwargs.get("max_new_tokens") or (out.shape[1] - prompt_len)
    eos = set(processor.eos_token_ids)
    others = [p for p in (kwargs.get("logits_processor") or []) if p is not processor]
    rest = {
        k: v
        for k, v in kwargs.items()
        if k
        not in (
            "input_ids",
            "inputs",
            "attention_mask",
            "max_new_tokens",
            "max_length",
            "logits_processor",
            "num_return_sequences",
            "min_new_tokens",
            "min_length",
        )
    }
    rows = {}
    for r in failed:
        i = r // per_input
        prompt = inputs[i][mask[i].bool()] if mask is not None else inputs[i]
        generated = _cut(out[r, prompt_len:].tolist(), eos)
        state, retry = processor.states[r], RowRetry()
        while (keep := retry.plan(state, max_new)) is not None:
            sub = copy.copy(processor)
            sub.grammars = [processor.grammars[r // per_grammar]]
            sub.resume(keep, retry.forbid, retry.reason)
            ids = torch.cat([prompt, torch.tensor(generated[:keep], dtype=prompt.dtype)]).unsqueeze(0)
            logger.info(
                "grammar row %d: %s; retry %d from token %d", r, processor.finish_reasons[r], retry.retries, keep
            )
            new = original(
                model,
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new - keep,
                logits_processor=[*others, sub],
                **rest,
            )
            generated = generated[:keep] + _cut(new[0, ids.shape[1] :].tolist(), eos)
            state, reasons[r] = sub.states[0], sub.finish_reasons[0]
            if not (reasons[r] or "").startswith("check_failed"):
                break
        rows[r] = generated
    pad = kwargs.get("pad_token_id")
    if pad is None:
        pad = model.generation_config.pad_token_id
    if pad is None:
        pad = next(iter(eos))
    width = max(out.shape[1], *(prompt_len + len(g) for g in rows.values()))
    result = out.new_full((out.shape[0], width), pad)
    result[:, : out.shape[1]] = out
    for r, generated in rows.items():
        result[r, prompt_len:] = pad
        result[r, prompt_len : prompt_len + len(generated)] = torch.tensor(generated, dtype=out.dtype)
    return result, reasons


def row_finish_reasons(out, prompt_len: int, eos, reasons: list) -> list[str]:
    """Per row of `out` ([B, T] ids): a failure the grammar named, else "eos" (an EOS was generated) or "length"."""
    ended = [any(t in eos for t in row) for row in out[:, prompt_len:].tolist()]
    return [why if why and why != "eos" else ("eos" if end else "length") for why, end in zip(reasons, ended)]


def _cut(tokens: list[int], eos: set) -> list[int]:
    """`tokens` up to and including the first EOS."""
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[: j + 1]
    return tokens
