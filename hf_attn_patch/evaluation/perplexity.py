"""Perplexity of a model on a text, and its KL divergence from a reference model: how conversions are judged.

Protocol: the text is tokenized once with the model's tokenizer, cut into non-overlapping windows of `ctx` tokens
(at most `max_tokens` tokens in all); every window predicts its tokens 2..ctx.
    perplexity = exp(mean over predicted tokens of -log p_model(token))
    KL         = mean over predicted positions of sum_v p_ref(v) (log p_ref(v) - log p_model(v))
Log-softmax and the sums run in float64: in float32 the rounding of each log-probability (eps 1.2e-7 times its
size) leaves a KL floor of about 1e-7 even for identical distributions, which would hide exact conversions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


@dataclass
class EvalResult:
    perplexity: float
    tokens: int  # predicted tokens
    windows: int
    ctx: int
    kl_to_reference: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def windows_of(text: str, tokenizer, ctx: int, max_tokens: int | None) -> torch.Tensor:
    """[n, ctx] token windows of `text` (raises ValueError when the text gives less than one window)."""
    if not isinstance(ctx, int) or ctx < 2:
        raise ValueError(f"ctx={ctx!r} must be an integer >= 2")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < ctx):
        raise ValueError(f"max_tokens={max_tokens!r} must be an integer >= ctx={ctx}")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = len(ids) // ctx
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of ctx={ctx}")
    return ids[: n * ctx].view(n, ctx)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, reference=None, progress: bool = True) -> EvalResult:
    """Perplexity of `model` on token windows [n, ctx], and the mean KL(reference || model) if given."""
    if reference is not None and reference.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"reference vocab_size={reference.config.vocab_size} differs from the model's "
            f"{model.config.vocab_size}: KL needs the same tokenizer"
        )
    nll, kl, count = 0.0, 0.0, 0
    for window in tqdm(windows, desc="eval windows", disable=not progress):
        ids = window[None].to(model.device)
        log_p = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
        targets = ids[0, 1:]
        nll -= log_p.gather(1, targets[:, None]).sum().item()
        if reference is not None:
            log_q = torch.log_softmax(reference(ids.to(reference.device)).logits[0, :-1].double(), dim=-1)
            kl += (log_q.exp() * (log_q - log_p.to(log_q.device))).sum().item()
        count += len(targets)
    return EvalResult(
        perplexity=math.exp(nll / count),
        tokens=count,
        windows=len(windows),
        ctx=windows.shape[1],
        kl_to_reference=None if reference is None else kl / count,
    )


def read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--text {str(path)!r} is not a file")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"--text {str(path)!r} is empty")
    return text
