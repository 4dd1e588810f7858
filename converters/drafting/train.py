"""Training a feature drafter on teacher samples: its draft vocabulary, its initial weights, the distillation loop.

Loss at unrolled depth s = 1..depth (EAGLE-3's training-time test): at depth 1 position i reads the target's real
h_{i-1}; at depth s > 1 it reads the drafter's own depth s-1 output g_{i-1}, as drafting the s-th token does. Each
depth adds DEPTH_DECAY^(s-1) x [soft cross-entropy to the target's next-token distribution over the draft vocabulary
+ FEATURE_WEIGHT x smooth-L1(g_i, h_i)].
"""

from __future__ import annotations

import logging
import math

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from ...speculative.feature_drafter import FeatureDrafterConfig, FeatureDrafterForCausalLM

logger = logging.getLogger(__name__)

DEPTH_DECAY = 0.8
FEATURE_WEIGHT = 0.1
WARMUP = 20  # steps of linear learning-rate warm-up, then a cosine down to 10%


def draft_vocabulary(tokens: torch.Tensor, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The `size` ids the teacher samples hold most often (plus `always`, e.g. EOS), sorted."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size).double()
    counts[list(always)] = float("inf")
    return counts.topk(min(size, vocab_size)).indices.sort().values


def new_drafter(target, ids: torch.Tensor, max_draft_tokens: int = 6) -> FeatureDrafterForCausalLM:
    """A drafter shaped like one of the target's layers (Llama-style), its layer started from the target's last
    layer when the shapes allow (else random)."""
    text = target.config.get_text_config(decoder=True)
    dim, heads = text.hidden_size, text.num_attention_heads
    config = FeatureDrafterConfig(
        vocab_size=text.vocab_size,
        hidden_size=dim,
        num_hidden_layers=1,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * dim,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or dim // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", None) or 1e-6,
        rope_parameters=getattr(text, "rope_parameters", None),
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 4096,
        draft_vocab_size=len(ids),
        max_draft_tokens=max_draft_tokens,
        drafts_for={
            "name_or_path": str(getattr(target.config, "name_or_path", "")),
            "model_type": target.config.model_type,
            "hidden_size": dim,
            "vocab_size": text.vocab_size,
        },
    )
    drafter = FeatureDrafterForCausalLM(config)
    drafter.draft_token_ids.copy_(ids)
    last = target.get_decoder().layers[-1] if hasattr(target.get_decoder(), "layers") else None
    if last is not None:
        mine = drafter.layer.state_dict()
        theirs = {k: v for k, v in last.state_dict().items() if k in mine and v.shape == mine[k].shape}
        if len(theirs) == len(mine):
            drafter.layer.load_state_dict(theirs)
            logger.info("drafter layer started from the target's last layer")
    drafter.bind(target)
    return drafter


def train_drafter(
    drafter: FeatureDrafterForCausalLM,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    steps: int,
    rows: int = 8,
    lr: float = 1e-3,
    depth: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> list[float]:
    """Train on teacher samples tokens [n, T] / hidden [n, T - 1, D]; returns the loss of every step."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps))
    drafter.train()
    losses = []
    for _ in tqdm(range(steps), desc="drafter training", disable=not progress):
        batch = torch.randint(0, len(tokens), (rows,), generator=generator)
        loss = drafter_loss(drafter, tokens[batch, :-1], hidden[batch], depth)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    drafter.eval()
    return losses


def drafter_loss(drafter, tokens: torch.Tensor, hidden: torch.Tensor, depth: int) -> torch.Tensor:
    """tokens [b, L], hidden [b, L, D]: h_i of each position (see the module docstring)."""
    head = drafter._target["head"]
    with torch.no_grad():
        teacher = torch.softmax(hidden @ head.T, dim=-1)  # [b, L, N]
    previous, total = _shift(hidden), 0.0
    for s in range(depth):
        out = drafter(tokens, previous, use_cache=False)
        ce = -(teacher * torch.log_softmax(out.logits, dim=-1)).sum(-1).mean()
        total = total + DEPTH_DECAY**s * (ce + FEATURE_WEIGHT * F.smooth_l1_loss(out.features, hidden))
        previous = _shift(out.features)
    return total


@torch.no_grad()
def agreement(drafter, tokens: torch.Tensor, hidden: torch.Tensor, depth: int) -> list[float]:
    """Share of positions where the drafter's top token at depth s equals the target's (full-vocabulary) top."""
    full_head = drafter._target["model"].get_output_embeddings().weight
    target_top = (hidden @ full_head.T.to(hidden.dtype)).argmax(-1)
    previous, result = _shift(hidden), []
    for _ in range(depth):
        out = drafter(tokens[:, :-1], previous, use_cache=False)
        drafted = drafter.draft_token_ids[out.logits.argmax(-1)]
        result.append(float((drafted == target_top).double().mean()))
        previous = _shift(out.features)
    return result


def _shift(features: torch.Tensor) -> torch.Tensor:
    """Position i gets features[i - 1]; position 0 gets zeros (a row's first token has no previous state)."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def _lr_factor(step: int, steps: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = (step - WARMUP) / max(steps - WARMUP, 1)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))
