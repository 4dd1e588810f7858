"""Healing: distill the source model into the converted one (the user's "uptrain"), through accelerate.

loss = KL(teacher || student) per token (+ lm_weight * next-token cross-entropy), averaged over the batch; AdamW with
a linear warmup over the first tenth of the steps, then a cosine decay to a tenth of `lr` (a converted model starts
close to its teacher: a full-size first step would throw that away). accelerate
places the models and handles mixed precision and data parallelism, so the same loop runs on one CPU or, started with
`accelerate launch --multi_gpu` / `torchrun`, as data parallel (DDP) on many GPUs or CPU processes: each process
takes its own windows of every step. Started with `accelerate launch --config_file <FSDP config, fsdp_version: 2>`,
the student and the teacher are sharded over the processes instead (FSDP2, heal_fsdp.py): the same steps on the same
windows, for models no single device holds. DeepSpeed (ZeRO-3) and FSDP1 are refused (heal_fsdp.launch_mode).

Low-precision weights (a bf16 or fp16 model, as a 7B source is): Adam steps fp32 master copies of the trainable
weights and every step rounds them into the model (MasterWeights); stepping a bf16 weight directly loses every
update below half its ulp.

Never worse on held-in data: with `held_in` windows (never trained on), the mean KL there is measured before the
first step and every `eval_every` steps, and the trainable weights of the best measurement are restored at the end
(the start counts, so a diverging run returns its starting model). lr="auto": a range test from the start, each of
AUTO_LRS for `probe` steps at a constant rate (optimizer state reset between them), the rate with the lowest held-in
KL is used (the weights go back to the start first). Distillation text from the source model's own distribution:
calibration.sample_from_teacher.

Balanced factors: before the first step every latent factor pair is rebalanced (balance.py), the same function in
a basis where Adam's steps of about lr per weight are alike for both factors (a closed form's factors can differ in
scale by 1e5, and a step sized for one wipes out the other).

Like the rest of the converter, healing runs torch's F.linear for every linear layer (fast_linear.disabled()): its
result does not depend on the CPU inference fast path.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...attention import VariantAttention
from ...models import fast_linear
from ...models.architectures import architecture_of
from ...variants import variant_of
from .balance import balance, has_latent_factors
from .heal_fsdp import FSDP_DIR, Sharded, launch_mode
from .heal_masters import MasterWeights, load_tensors, save_tensors

logger = logging.getLogger(__name__)

TRAINABLE = ("attention", "all")
BEST_FILE, BEST_META = "heal_best.safetensors", "heal_best.json"  # beside accelerate's checkpoint
MASTERS_FILE = "heal_masters.safetensors"  # the fp32 master weights of a low-precision student, beside it too
AUTO_LRS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)  # the range test of lr="auto"


@dataclass
class HealResult:
    steps: int
    tokens: int
    seconds: float
    losses: list[float] = field(default_factory=list)
    lr: float = 0.0  # the rate used (lr="auto": the range test's pick)
    held_in: list[tuple[int, float]] = field(default_factory=list)  # (step, mean held-in KL); step 0: the start
    best_step: int = 0  # the step whose weights were returned (0: the start)
    range_test: dict[float, float] = field(default_factory=dict)  # lr="auto": held-in KL after each probe

    @property
    def improved(self) -> bool | None:
        """Whether a step beat the start on the held-in windows (None: no held-in windows were measured); False
        means the run diverged or stalled, and the start was returned."""
        return None if not self.held_in else self.best_step > 0


@fast_linear.disabled()  # the teacher's and held-in passes run F.linear, as in convert() (models/fast_linear.py)
def heal(
    student,
    teacher,
    windows: torch.Tensor,
    *,
    steps: int,
    lr: float | str = 1e-4,
    batch_size: int = 1,
    train: str = "attention",
    lm_weight: float = 0.0,
    gradient_checkpointing: bool = False,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    held_in: torch.Tensor | None = None,
    eval_every: int | None = None,
    probe: int | None = None,
    weights: torch.Tensor | None = None,
    held_in_weights: torch.Tensor | None = None,
    progress: bool = True,
) -> HealResult:
    """Train `student` in place for `steps` optimizer steps on token windows [n, L]; `teacher` stays frozen.

    train="attention" updates only the converted attention layers; "all" updates every weight.
    With checkpoint_dir, the optimizer/model state is saved every `checkpoint_every` steps; resume=True continues
    from the last one saved there. held_in [m, L]: windows for keeping the best state (module docstring), checked
    every eval_every steps (default steps // 10); lr="auto" (needs held_in): the range test, `probe` steps per rate
    (default max(1, min(10, steps // 10))). weights [n, L - 1] / held_in_weights [m, L - 1]: the KL's weight at each
    predicted position (io/heal_data.py; default: every position counts the same).
    """
    from accelerate import Accelerator

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive integer")
    if train not in TRAINABLE:
        raise ValueError(f"train={train!r} is not one of {TRAINABLE}")
    if lr == "auto":
        if held_in is None:
            raise ValueError("lr='auto' needs held_in windows (the range test measures on them)")
    elif isinstance(lr, str) or not lr > 0:
        raise ValueError(f"lr={lr!r} must be positive or 'auto'")
    for name, w, ids in (("weights", weights, windows), ("held_in_weights", held_in_weights, held_in)):
        if w is not None and (ids is None or tuple(w.shape) != (ids.shape[0], ids.shape[1] - 1)):
            shape = None if ids is None else (ids.shape[0], ids.shape[1] - 1)
            raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {shape} (one per predicted position)")
    if eval_every is not None and (not isinstance(eval_every, int) or eval_every < 1):
        raise ValueError(f"eval_every={eval_every!r} must be a positive integer")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir")
    launch_mode()  # raises for DeepSpeed / FSDP1 launches, before any work
    use_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    accelerator = Accelerator(mixed_precision="bf16" if use_bf16 else "no", cpu=not torch.cuda.is_available())
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    sharded_launch = launch_mode(accelerator) == "fsdp"
    if resume and sharded_launch != (ckpt / FSDP_DIR).exists() and (ckpt / "step.txt").exists():
        kind = "a data-parallel" if sharded_launch else "a sharded (FSDP)"
        raise ValueError(
            f"checkpoint_dir={str(ckpt)!r} holds {kind} healing state: resume it with the launch that wrote it"
        )
    params = _trainable(student, train)
    if not params:
        raise ValueError("the student has no attention layers to train (train='attention')")
    # a model with latents is rebalanced; its weights as given are kept to return, bit for bit, if no step beats them
    unbalanced = [p.detach().clone() for p in params] if has_latent_factors(student) else None
    if unbalanced is not None:
        balance(student)
    model = student  # the caller's model; `student` below: what trains (the DDP wrapper, or the sharded copy)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    sharded = None
    if sharded_launch:  # the caller's models stay where they are; their sharded copies go to the device
        sharded = Sharded(model, teacher, accelerator)
        student, teacher, params = sharded.student, sharded.teacher, sharded.params
    else:
        student.to(accelerator.device)  # before the masters are copied: they live where their weights do
    masters = MasterWeights(params)  # sharded: the trainable weights themselves (fp32 already)
    optimizer = torch.optim.AdamW(masters.tensors, lr=1e-4 if lr == "auto" else lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))
    )
    if sharded is None:
        student, optimizer = accelerator.prepare(student, optimizer)
        # Not prepared: accelerate's scheduler wrapper steps once per process per step. Saved with the checkpoints.
        accelerator.register_for_checkpointing(schedule)
        teacher = teacher.to(accelerator.device)
    teacher.eval()
    start_step, saved, best_state = 0, None, None
    if resume and sharded is not None and (ckpt / "step.txt").exists():
        start_step, saved, best_state = sharded.load(ckpt, optimizer, schedule, masters.tensors)
    elif resume and (ckpt / "step.txt").exists():
        accelerator.load_state(str(ckpt))
        start_step = int((ckpt / "step.txt").read_text())
        if (ckpt / MASTERS_FILE).exists():
            masters.restore(load_tensors(ckpt / MASTERS_FILE, len(params)))
        if (ckpt / BEST_FILE).exists():
            saved, best_state = json.loads((ckpt / BEST_META).read_text()), load_tensors(ckpt / BEST_FILE, len(params))
    result = HealResult(steps=0, tokens=0, seconds=0.0)
    started = time.perf_counter()
    held = None
    if held_in is not None:
        weights_in = None if held_in_weights is None else held_in_weights.to(accelerator.device)
        held = HeldIn(held_in.to(accelerator.device), weights_in)

    def measure() -> float:
        kl = held.kl(student, teacher)
        if sharded is not None:  # every process measures the same windows; the mean makes their choices one
            kl = accelerator.reduce(torch.tensor(kl, dtype=torch.float64, device=accelerator.device), "mean").item()
        return kl

    best_kl = float("inf")
    if held is not None and start_step == 0:
        start_kl = measure()
        result.held_in.append((0, start_kl))
        best_kl, best_state = start_kl, masters.copy()
    elif saved is not None:  # resumed: the best state and the rate of the first run
        best_kl, result.best_step, result.held_in = (
            saved["best_kl"],
            saved["best_step"],
            [tuple(x) for x in saved["held_in"]],
        )
        result.range_test = {float(k): v for k, v in saved["range_test"].items()}
        lr = saved["lr"] if lr == "auto" else lr
    if lr == "auto":
        lr = _range_test(
            student,
            teacher,
            optimizer,
            masters,
            windows,
            weights,
            batch_size,
            lm_weight,
            accelerator,
            probe or max(1, min(10, steps // 10)),
            result,
            best_state,
            measure,
        )
        schedule.base_lrs = [lr for _ in schedule.base_lrs]
        for group in optimizer.param_groups:
            group["initial_lr"], group["lr"] = lr, lr * schedule.lr_lambdas[0](schedule.last_epoch)
    result.lr = lr
    every = eval_every or max(1, steps // 10)
    student.train()
    bar = tqdm(range(start_step, steps), desc="heal", disable=not progress or not accelerator.is_main_process)
    for step in bar:  # each process takes its own batch_size windows of every step: data parallel
        first = (step * accelerator.num_processes + accelerator.process_index) * batch_size
        rows = torch.arange(first, first + batch_size) % len(windows)
        loss = _step(
            student,
            teacher,
            optimizer,
            masters,
            windows[rows].to(accelerator.device),
            _rows(weights, rows, accelerator.device),
            lm_weight,
            accelerator,
        )
        schedule.step()
        result.losses.append(loss.item())
        result.tokens += len(rows) * windows.shape[1] * accelerator.num_processes
        result.steps = step + 1
        bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{result.tokens / (time.perf_counter() - started):.0f}")
        if held is not None and (result.steps % every == 0 or result.steps == steps):
            kl = measure()
            result.held_in.append((result.steps, kl))
            student.train()
            if best_state is not None and kl < best_kl:
                best_kl, best_state, result.best_step = kl, masters.copy(), result.steps
        if ckpt is not None and checkpoint_every and result.steps % checkpoint_every == 0:
            meta = (
                None
                if best_state is None
                else {
                    "best_kl": best_kl,
                    "best_step": result.best_step,
                    "lr": lr,
                    "held_in": result.held_in,
                    "range_test": result.range_test,
                }
            )
            if sharded is not None:  # step.txt too
                sharded.save(ckpt, optimizer, result.steps, schedule, best_state, meta)
                continue
            accelerator.save_state(str(ckpt))
            if masters.separate and accelerator.is_main_process:
                save_tensors(masters.tensors, ckpt / MASTERS_FILE)
            if best_state is not None and accelerator.is_main_process:
                save_tensors(best_state, ckpt / BEST_FILE)
                (ckpt / BEST_META).write_text(json.dumps(meta))
            (ckpt / "step.txt").write_text(str(result.steps))
    accelerator.wait_for_everyone()
    student.eval()
    if best_state is not None and result.best_step != result.steps:
        masters.restore(best_state)
        logger.info(
            "healing: restored step %d (held-in KL %.4f; last %.4f)", result.best_step, best_kl, result.held_in[-1][1]
        )
    if result.improved is False:
        logger.warning(
            "healing did not lower the held-in KL (start %.4f, then %s): the start is returned; lower the "
            "learning rate (lr %g)",
            result.held_in[0][1],
            ", ".join(f"{kl:.4f}" for _, kl in result.held_in[1:]),
            lr,
        )
    if sharded is not None:
        sharded.copy_into(model)
    if unbalanced is not None and result.best_step == 0 and best_state is not None:  # the start, bit for bit
        with torch.no_grad():
            for p, original in zip(params if sharded is None else _trainable(model, train), unbalanced):
                p.copy_(original)
    model.eval()
    if gradient_checkpointing:
        model.gradient_checkpointing_disable()
    for p in model.parameters():
        p.requires_grad_(True)
    result.seconds = time.perf_counter() - started
    logger.info(
        "healed %d steps, %d tokens, %.1f s, last loss %.4f",
        result.steps,
        result.tokens,
        result.seconds,
        result.losses[-1] if result.losses else float("nan"),
    )
    return result


def _rows(weights: torch.Tensor | None, rows: torch.Tensor, device) -> torch.Tensor | None:
    return None if weights is None else weights[rows].to(device)


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """mean of values [b, L - 1], or sum(w values) / sum(w) with weights [b, L - 1]."""
    return values.mean() if weights is None else (weights * values).sum() / weights.sum().clamp_min(1e-12)


def _step(student, teacher, optimizer, masters, ids, weights, lm_weight, accelerator) -> torch.Tensor:
    """One optimizer step of KL(teacher || student) (+ lm_weight x cross-entropy) on ids [b, L], the KL weighted per
    predicted position by weights [b, L - 1] (None: all alike); the loss. The LM head and the log-softmax run only at
    the positions some row weighs (`weighted_positions`): a retrieval window weighs ~100 of ~1,000."""
    positions = weighted_positions(weights)
    with torch.no_grad():
        target = torch.log_softmax(logits_at(teacher, ids, positions).float(), dim=-1)
    with accelerator.autocast():
        logits = logits_at(student, ids, positions).float()
    log_q = torch.log_softmax(logits, dim=-1)
    kept = weights if positions is None else weights[:, positions]
    loss = _weighted_mean((target.exp() * (target - log_q)).sum(-1), kept)
    if lm_weight:
        labels = ids[:, 1:] if positions is None else ids[:, positions + 1]
        loss = loss + lm_weight * torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    accelerator.backward(loss)
    masters.step(optimizer)
    return loss


def weighted_positions(weights: torch.Tensor | None) -> torch.Tensor | None:
    """The predicted positions [k] that some row of weights [b, L - 1] counts, or None when that is all of them (or
    weights is None): the only positions whose logits the weighted KL needs."""
    if weights is None:
        return None
    kept = (weights != 0).any(0).nonzero()[:, 0]
    return None if len(kept) == weights.shape[1] else kept


def logits_at(model, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """model's logits [b, k, vocab] on ids [b, L] at the predicting positions [k] (None: [b, L - 1], every one but the
    last). The LM head runs on those positions only where the model takes `logits_to_keep` (transformers' causal
    LMs do; a tensor there selects positions), else the full logits are cut."""
    if positions is None:
        return model(ids).logits[:, :-1]
    base = getattr(model, "module", model)  # a DDP wrapper forwards any keyword; its module's signature tells
    if "logits_to_keep" in inspect.signature(base.forward).parameters:
        return model(ids, logits_to_keep=positions.to(ids.device)).logits
    return model(ids).logits[:, positions.to(ids.device)]


def _range_test(
    student,
    teacher,
    optimizer,
    masters,
    windows,
    weights,
    batch_size,
    lm_weight,
    accelerator,
    probe,
    result: HealResult,
    start_state,
    measure,
) -> float:
    """The rate of AUTO_LRS whose `probe` constant-rate steps from the start reach the lowest held-in KL; the
    weights and optimizer state go back to the start after every probe."""
    state = masters.copy() if start_state is None else start_state
    for rate in AUTO_LRS:
        student.train()
        for group in optimizer.param_groups:
            group["lr"] = rate
        for step in range(probe):
            rows = torch.arange(step * batch_size, (step + 1) * batch_size) % len(windows)
            _step(
                student,
                teacher,
                optimizer,
                masters,
                windows[rows].to(accelerator.device),
                _rows(weights, rows, accelerator.device),
                lm_weight,
                accelerator,
            )
        result.range_test[rate] = measure()
        masters.restore(state)
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.state.clear()
    best = min(result.range_test, key=result.range_test.get)
    logger.info("healing lr range test %s: lr %g", {k: round(v, 4) for k, v in result.range_test.items()}, best)
    return best


class HeldIn:
    """The held-in windows [m, L] (and weights [m, L - 1]) with the teacher's log-probabilities at their weighted
    positions, computed at the first measurement and kept on the CPU for the later ones (the teacher is frozen)
    while they take at most KEEP_BYTES; larger ones (a large vocabulary, long windows) are computed every time."""

    CHUNK_TOKENS = 4096  # tokens of windows per forward: bounds the [tokens, vocab] logits held at once
    KEEP_BYTES = 1 << 30

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor | None = None):
        self.chunk = max(1, self.CHUNK_TOKENS // ids.shape[1])
        self.ids = ids.split(self.chunk)
        self.weights = [None] * len(self.ids) if weights is None else list(weights.split(self.chunk))
        self.targets: list[torch.Tensor] | None = None

    @torch.no_grad()
    def kl(self, student, teacher) -> float:
        """Mean KL(teacher || student) per weighted predicted token (student in eval mode)."""
        student.eval()
        targets = self.targets or [None] * len(self.ids)
        total, count, kept, size = 0.0, 0.0, [], 0
        for ids, w, log_p in zip(self.ids, self.weights, targets):
            positions = weighted_positions(w)
            if log_p is None:
                log_p = torch.log_softmax(logits_at(teacher, ids, positions).float(), dim=-1)
                size += log_p.numel() * log_p.element_size()
                kept = kept + [log_p.cpu()] if size <= self.KEEP_BYTES else []
            log_q = torch.log_softmax(logits_at(student, ids, positions).float(), dim=-1)
            log_p = log_p.to(log_q.device)
            w = torch.ones(log_p.shape[:2]) if w is None else (w if positions is None else w[:, positions])
            total += float((w.to(log_p.device) * (log_p.exp() * (log_p - log_q)).sum(-1)).sum())
            count += float(w.sum())
        if self.targets is None and len(kept) == len(self.ids):
            self.targets = kept
        return total / max(count, 1e-12)


def _held_in_kl(student, teacher, held: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Mean KL(teacher || student) per predicted token over the held-in windows [m, L] (student in eval mode),
    weighted per predicted position by weights [m, L - 1] when given."""
    return HeldIn(held, weights).kl(student, teacher)


def plot_curve(losses: list[float], held_in: list[tuple[int, float]], best_step: int, lr: float, path) -> None:
    """PNG of the held-in KL against the step (the returned state marked), and the training loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses, color="tab:gray", alpha=0.5, label="training KL")
    if held_in:
        ax.plot(*zip(*held_in), marker="o", color="tab:red", label="held-in KL")
        best = dict(held_in).get(best_step)
        if best is not None:
            ax.plot(
                [best_step],
                [best],
                marker="*",
                markersize=14,
                color="black",
                linestyle="",
                label=f"returned (step {best_step})",
            )
    ax.set(xlabel="step", ylabel="KL(source || converted) per token", title=f"healing, lr {lr:g}")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _trainable(model, train: str) -> list[torch.nn.Parameter]:
    """Every weight, or those of the attention layers: what each variant says healing trains (variants.py), or every
    weight of the stock class of a stock-format GQA export."""
    if train == "all":
        return list(model.parameters())
    stock_name = architecture_of(model.config).attention_class
    return [
        p
        for m in model.modules()
        for p in (
            variant_of(m.variant).trainable(m)
            if isinstance(m, VariantAttention)
            else m.parameters()
            if type(m).__name__ == stock_name
            else ()
        )
    ]
