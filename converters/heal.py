"""Healing: distill the source model into the converted one (the user's "uptrain"), through accelerate.

loss = KL(teacher || student) per token (+ lm_weight * next-token cross-entropy), averaged over the batch; AdamW with
a linear warmup over the first tenth of the steps, then a cosine decay to a tenth of `lr` (a converted model starts
close to its teacher: a full-size first step would throw that away). accelerate
places the models and handles mixed precision and data parallelism, so the same loop runs on one CPU or, started with
`accelerate launch --multi_gpu` / `torchrun`, as data parallel (DDP) on many GPUs or CPU processes: each process
takes its own windows of every step. Sharded training (FSDP, DeepSpeed ZeRO-3) is refused: the weights would have
to be gathered before the converter writes them, and that path is not built.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..attention import GroupedQueryAttention, MultiHeadLatentAttention
from ..models.architectures import architecture_of

logger = logging.getLogger(__name__)

TRAINABLE = ("attention", "all")


@dataclass
class HealResult:
    steps: int
    tokens: int
    seconds: float
    losses: list[float] = field(default_factory=list)


def heal(student, teacher, windows: torch.Tensor, *, steps: int, lr: float = 1e-4, batch_size: int = 1,
         train: str = "attention", lm_weight: float = 0.0, gradient_checkpointing: bool = False,
         checkpoint_dir: str | Path | None = None, checkpoint_every: int = 0, resume: bool = False,
         progress: bool = True) -> HealResult:  # fmt: skip
    """Train `student` in place for `steps` optimizer steps on token windows [n, L]; `teacher` stays frozen.

    train="attention" updates only the converted attention layers; "all" updates every weight.
    With checkpoint_dir, the optimizer/model state is saved every `checkpoint_every` steps; resume=True continues
    from the last one saved there.
    """
    from accelerate import Accelerator

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive integer")
    if train not in TRAINABLE:
        raise ValueError(f"train={train!r} is not one of {TRAINABLE}")
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be positive")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir")
    use_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    accelerator = Accelerator(mixed_precision="bf16" if use_bf16 else "no", cpu=not torch.cuda.is_available())
    if accelerator.distributed_type.name in ("FSDP", "DEEPSPEED"):
        raise ValueError(f"healing under {accelerator.distributed_type.name} is not supported: launch data parallel "
                         "(accelerate launch --multi_gpu, or torchrun)")  # fmt: skip
    params = _trainable(student, train)
    if not params:
        raise ValueError("the student has no attention layers to train (train='attention')")
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    if gradient_checkpointing:
        student.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))
    )
    student, optimizer = accelerator.prepare(student, optimizer)
    # Not prepared: accelerate's scheduler wrapper steps once per process per step. Saved with the checkpoints.
    accelerator.register_for_checkpointing(schedule)
    teacher = teacher.to(accelerator.device).eval()
    start_step = 0
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if resume and (ckpt / "step.txt").exists():
        accelerator.load_state(str(ckpt))
        start_step = int((ckpt / "step.txt").read_text())
    student.train()
    result = HealResult(steps=0, tokens=0, seconds=0.0)
    started = time.perf_counter()
    bar = tqdm(range(start_step, steps), desc="heal", disable=not progress or not accelerator.is_main_process)
    for step in bar:  # each process takes its own batch_size windows of every step: data parallel
        first = (step * accelerator.num_processes + accelerator.process_index) * batch_size
        rows = torch.arange(first, first + batch_size) % len(windows)
        ids = windows[rows].to(accelerator.device)
        with torch.no_grad():
            target = torch.log_softmax(teacher(ids).logits[:, :-1].float(), dim=-1)
        with accelerator.autocast():
            logits = student(ids).logits[:, :-1].float()
        log_q = torch.log_softmax(logits, dim=-1)
        loss = (target.exp() * (target - log_q)).sum(-1).mean()
        if lm_weight:
            loss = loss + lm_weight * torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        accelerator.backward(loss)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(loss.item())
        result.tokens += ids.numel() * accelerator.num_processes
        result.steps = step + 1
        bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{result.tokens / (time.perf_counter() - started):.0f}")
        if ckpt is not None and checkpoint_every and result.steps % checkpoint_every == 0:
            accelerator.save_state(str(ckpt))
            (ckpt / "step.txt").write_text(str(result.steps))
    accelerator.wait_for_everyone()
    student.eval()
    if gradient_checkpointing:
        student.gradient_checkpointing_disable()
    for p in student.parameters():
        p.requires_grad_(True)
    result.seconds = time.perf_counter() - started
    logger.info("healed %d steps, %d tokens, %.1f s, last loss %.4f", result.steps, result.tokens, result.seconds,
                result.losses[-1] if result.losses else float("nan"))  # fmt: skip
    return result


def _trainable(model, train: str) -> list[torch.nn.Parameter]:
    """Every weight, or those of the attention layers: ours, or the stock class of a stock-format GQA export."""
    if train == "all":
        return list(model.parameters())
    stock_name = architecture_of(model.config).attention_class
    layers = [m for m in model.modules()
              if isinstance(m, (GroupedQueryAttention, MultiHeadLatentAttention)) or type(m).__name__ == stock_name]
    return [p for layer in layers for p in layer.parameters()]
