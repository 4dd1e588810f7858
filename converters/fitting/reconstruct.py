"""Layer by layer after the closed form: propagated calibration and one-shot reconstruction of each attention layer.

The converted model is walked one decoder layer at a time on the calibration windows, its residual stream
H'_l [n, T, D] carried from layer to layer (one full forward in all, never a backward through the model):
    X'_l = the converted layer l's attention input (after its norm), computed from H'_l: the converted prefix < l;
    propagated calibration: the closed form of layer l is recomputed from statistics of X'_l (GPTQ's sequential
        mode), so the layer's fit sees the error of the layers before it; kept only if it lowers the held-in error;
    reconstruction: every weight of the converted attention layer (MLA: q, the latent down/up projections and the
        RoPE key, o; GQA: q, the merged k / v, o) is fitted by Adam to
            min E ||A'_l(X'_l) - Y_l||^2 / E ||Y_l||^2,  Y_l = A_l(X_l) (target "source": the source layer on the
            source's own inputs, so the fit absorbs the prefix's error) or A_l(X'_l) (target "local"),
        A the true attention (softmax, RoPE, causal mask) of the module itself; target "block" (layer-wise
        distillation, healing's first stage): the decoder layer's output B'_l(H'_l) matches the source's H_{l+1}
        (the same attention weights train, through the MLP and the residual, so the layer also cancels the residual
        stream's error so far); the state with the lowest error on
        the held-in windows (the last `held_in` share of the calibration windows, never trained on) is kept, the
        closed form counting as step 0, so a layer never leaves worse on held-in data than it came.
    attention KL (targets "source" and "local", weight lambda > 0): the objective adds
            lambda * mean over heads and queries of KL(P_l || P'_l),  P = softmax(q k^T / sqrt(d) + causal mask),
        the source's attention pattern on its inputs against the converted one's, so a head's sharp, rare retrieval
        attention (small in the output error, whose average it barely moves) counts as much as its broad attention.
        The held-in objective that picks the kept state is the same sum.
Only one layer's weights train at a time, in float32 (a bf16 model's layer is upcast for its fit, then cast back).
Memory beyond the two models: H', X', Y (and H, X for target "source"): 5 x n x T x D floats. Target "block"
costs ~2.5x per step: the MLP's forward and backward join the attention's.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from ...models.architectures import AttentionShape
from ..io.calibration import LayerStats, stats_of_inputs
from ..methods.exact import stock_attention_layers

logger = logging.getLogger(__name__)

TARGETS = ("source", "local", "block")
LAYERWISE_LR = 3e-3  # target "block" after reconstruction (healing's first stage): a close start, a small step
Relift = Callable[[str, LayerStats], dict]  # (layer name, propagated stats) -> the layer's new state dict


@dataclass
class LayerFit:
    """What happened to one layer; errors are held-in relative output errors E||A'(X') - Y||^2 / E||Y||^2."""

    layer: str
    closed_form_error: float  # the closed form from the source's statistics
    propagated_error: float | None  # the closed form from the converted prefix's statistics (None: not tried)
    propagated_kept: bool
    error: float  # what the layer leaves with
    best_step: int  # 0: the closed form was kept
    seconds: float
    cpu_seconds: float
    attention_kl: float | None = None  # held-in mean attention KL of the kept state (None: not in the objective)


class _Stop(Exception):
    """Raised by a capture hook: the rest of the forward is not needed."""


def sequential(
    source: nn.Module,
    new: nn.Module,
    windows: torch.Tensor,
    *,
    relift: Relift | None = None,
    steps: int = 0,
    lr: float = 1e-2,
    batch_size: int = 4,
    held_in: float = 0.25,
    target: str = "source",
    attention_kl: float = 0.0,
    progress: bool = True,
) -> list[LayerFit]:
    """Propagate (relift != None) and / or reconstruct (steps > 0) every converted attention layer of `new` in place.

    windows: calibration tokens [n, T], n >= 2 (the last max(1, round(n * held_in)) are held in);
    lr: Adam's step as a fraction of each weight tensor's RMS (scale-free, so one default serves any model);
    attention_kl: the weight lambda of the attention-pattern KL in the objective (module docstring), 0: none.
    """
    _check(steps, lr, held_in, target, len(windows), attention_kl)
    names = list(stock_attention_layers(source))
    device = next(new.parameters()).device
    windows = windows.to(device)
    h_new, layer_kw = _first_layer_inputs(new, names[0], windows, batch_size)
    h_src, src_layer_kw = _first_layer_inputs(source, names[0], windows, batch_size)  # the source's positions
    fits, shape = [], AttentionShape.of(source.config)
    for name in tqdm(names, desc="reconstruct" if steps else "propagate", disable=not progress):
        block_new, block_src = new.get_submodule(_parent(name)), source.get_submodule(_parent(name))
        fits.append(
            fit_layer(
                name,
                block_src,
                block_new,
                h_src,
                h_new,
                src_layer_kw,
                layer_kw,
                shape,
                relift=relift,
                steps=steps,
                lr=lr,
                batch_size=batch_size,
                held_in=held_in,
                target=target,
                attention_kl=attention_kl,
            )
        )
        h_new = _run_block(block_new, h_new, layer_kw, batch_size)
        if target != "local":
            h_src = _run_block(block_src, h_src, src_layer_kw, batch_size)
    return fits


def fit_layer(
    name: str,
    block_src: nn.Module,
    block_new: nn.Module,
    h_src: torch.Tensor,
    h_new: torch.Tensor,
    src_kw: dict,
    new_kw: dict,
    shape: AttentionShape,
    *,
    relift: Relift | None = None,
    steps: int = 0,
    lr: float = 1e-2,
    batch_size: int = 4,
    held_in: float = 0.25,
    target: str = "source",
    attention_kl: float = 0.0,
) -> LayerFit:
    """Propagate and / or reconstruct the attention of one converted decoder layer `block_new` in place.

    name: the attention module's full name (model.layers.i.self_attn), its last part its name in the layer;
    h_src / h_new: the source's / the converted prefix's residual stream entering the layer [n, T, D] (h_src is
    read for target "source" and "block"; for "local" only its first window, for the attention's arguments);
    src_kw / new_kw: the decoder layers' other arguments (masks, positions, rotary cos/sin) for a batch of one.
    The last max(1, round(n * held_in)) windows are held in. Only the attention's weights change."""
    _check(steps, lr, held_in, target, len(h_new), attention_kl)
    started, cpu_started = time.perf_counter(), time.process_time()
    arch = shape.arch
    attr = name.rsplit(".", 1)[1]  # the attention module's name in its decoder layer
    attn_new, attn_src = block_new.get_submodule(attr), block_src.get_submodule(attr)
    held = max(1, round(len(h_new) * held_in))
    train_idx, held_idx = torch.arange(len(h_new) - held), torch.arange(len(h_new) - held, len(h_new))
    x_new, attn_kw = _attention_inputs(block_new, attn_new, h_new, new_kw, batch_size)
    pattern = None  # the source's attention patterns, when they join the objective
    if target == "block":  # the decoder layer's output (through its MLP) matches the source layer's
        y, fit_module, fit_x, fit_kw = _run_block(block_src, h_src, src_kw, batch_size), block_new, h_new, new_kw
    else:
        if target == "source":
            x_src, src_attn_kw = _attention_inputs(block_src, attn_src, h_src, src_kw, batch_size)
        else:
            x_src, src_attn_kw = x_new, _attention_inputs(block_src, attn_src, h_src[:1], src_kw, 1)[1]
        y, fit_module, fit_x, fit_kw = _outputs(attn_src, x_src, src_attn_kw, batch_size), attn_new, x_new, attn_kw
        if attention_kl:
            pattern = _Pattern(attn_src, x_src, src_attn_kw, attention_kl)

    def held_in() -> tuple[float, float | None]:
        """(output error, attention KL or None) on the held-in windows."""
        if pattern:
            return pattern.held_in(attn_new, x_new, attn_kw, y, held_idx, batch_size)
        return _error(fit_module, fit_x[held_idx], y[held_idx], fit_kw, batch_size), None

    objective = lambda measured: measured[0] + (pattern.weight * measured[1] if pattern else 0.0)  # noqa: E731
    closed = held_in()
    propagated, kept = None, False
    if relift is not None:
        saved = _clone_state(attn_new)
        stats = stats_of_inputs(x_new[train_idx], arch.split_heads(attn_src), shape)
        attn_new.load_state_dict(relift(name, stats))
        propagated = held_in()
        kept = objective(propagated) < objective(closed)
        if not kept:
            attn_new.load_state_dict(saved)
    (error, kl), best_step = propagated if kept else closed, 0
    if steps:
        (error, kl), best_step = _fit(
            fit_module,
            attn_new,
            fit_x,
            y,
            fit_kw,
            train_idx,
            steps,
            lr,
            batch_size,
            held_in,
            objective,
            (error, kl),
            pattern,
        )
    logger.info(
        "%s: held-in error %.4g (closed form) -> %.4g%s%s",
        name,
        closed[0],
        error,
        f" (propagated {propagated[0]:.4g}, {'kept' if kept else 'not kept'})" if propagated else "",
        f", attention KL {closed[1]:.4g} -> {kl:.4g}" if pattern else "",
    )
    return LayerFit(
        name,
        closed[0],
        propagated[0] if propagated else None,
        kept,
        error,
        best_step,
        time.perf_counter() - started,
        time.process_time() - cpu_started,
        attention_kl=kl,
    )


def _check(steps, lr, held_in, target, n, attention_kl=0.0) -> None:
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not one of {TARGETS}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps={steps!r} must be a non-negative integer")
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be positive")
    if not 0 < held_in < 1:
        raise ValueError(f"held_in={held_in!r} must be a fraction in (0, 1)")
    if n < 2:
        raise ValueError(f"{n} calibration window(s): reconstruction needs at least 2 (one held in)")
    if isinstance(attention_kl, bool) or not isinstance(attention_kl, (int, float)) or not attention_kl >= 0:
        raise ValueError(f"attention_kl={attention_kl!r} must be a non-negative number")
    if attention_kl and target == "block":
        raise ValueError("attention_kl needs target 'source' or 'local': target 'block' fits a decoder layer's output")


def summary(fits: list[LayerFit]) -> dict:
    """For the conversion report: per-layer errors, and the mean error before / after."""
    mean = lambda xs: float(sum(xs) / len(xs))  # noqa: E731
    return {
        "layers": [asdict(f) for f in fits],
        "mean_closed_form_error": mean([f.closed_form_error for f in fits]),
        "mean_error": mean([f.error for f in fits]),
        "propagated_kept": sum(f.propagated_kept for f in fits),
        "seconds": round(sum(f.seconds for f in fits), 2),
        "cpu_seconds": round(sum(f.cpu_seconds for f in fits), 2),
    }


@dataclass
class _Pattern:
    """The source attention's patterns P on its inputs x_src [n, T, D], and their KL to a converted attention's."""

    attn: nn.Module
    x: torch.Tensor
    kw: dict
    weight: float

    def loss(self, weights_new: torch.Tensor, idx) -> torch.Tensor:
        """weight * mean KL(P || P') of the windows idx, P' the converted attention's weights [B, H, T, S]."""
        with torch.no_grad():
            source = _with_weights(self.attn, self.x[idx], self.kw)[1].float()
        return self.weight * _kl(source, weights_new.float())

    @torch.no_grad()
    def held_in(self, attn_new, x_new, kw_new, y, idx, batch_size) -> tuple[float, float]:
        """(E||A'(x_new) - y||^2 / E||y||^2, mean KL(P || P') over heads and queries) on the windows idx, from one
        forward of the converted attention per batch."""
        dtype = next(attn_new.parameters()).dtype
        num = den = total = 0.0
        for s in range(0, len(idx), batch_size):
            part = idx[s : s + batch_size]
            source = _with_weights(self.attn, self.x[part], self.kw)[1].float()
            out, new = _with_weights(attn_new, x_new[part].to(dtype), kw_new)
            num += float((out.float() - y[part].float()).pow(2).sum())
            den += float(y[part].float().pow(2).sum())
            total += float(_kl(source, new.float())) * len(part)
        return num / max(den, 1e-300), total / len(idx)


def _kl(p: torch.Tensor, p_new: torch.Tensor) -> torch.Tensor:
    """Mean over [B, H, T] of sum_s p log(p / p_new); masked keys (p = p_new = 0) add 0, and so does their gradient
    (the clamp; 1e-30 is above float32's smallest normal)."""
    tiny = 1e-30
    return (p * (p.clamp_min(tiny).log() - p_new.clamp_min(tiny).log())).sum(-1).mean()


def _with_weights(attn, x, kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, attention weights [B, H, T, S]) of an attention module: its eager kernel for this call, with the
    causal mask made explicit (the SDPA path may pass None and let the kernel mask) and additive; an MLA module
    expands K / V for it (its absorbed form computes no weights)."""
    config, absorb = attn.config, getattr(attn, "absorb", None)
    implementation = config._attn_implementation
    kw = dict(kw, attention_mask=_additive_mask(kw.get("attention_mask"), x.shape[1], x.dtype))
    config._attn_implementation = "eager"
    if absorb is not None:
        attn.absorb = "never"
    try:
        out, weights = attn(x, **kw)
    finally:
        config._attn_implementation = implementation
        if absorb is not None:
            attn.absorb = absorb
    return out, weights


def _additive_mask(mask: torch.Tensor | None, length: int, dtype) -> torch.Tensor:
    """[1, 1, T, T] causal when None; a boolean mask (True: attend) as 0 / the dtype's minimum; else as given."""
    if mask is None:
        mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def _fit(module, attn, x, y, kw, train_idx, steps, lr, batch_size, held_in, objective, start, pattern):
    """Adam on every weight of `attn` (float32) so that module(x) matches y (module: attn itself, or the decoder
    layer holding it; plus pattern's KL when given), linear warmup over a tenth of the steps, then cosine decay.
    Keeps the state of the lowest objective(held_in()) (start: the current state's held_in()); returns
    (its held_in(), its step), step 0 for the start."""
    dtype = next(attn.parameters()).dtype
    module.float()
    params = [p for p in attn.parameters()]
    every = list(module.parameters())  # attn's and, for a decoder layer, the frozen rest (no gradient computed)
    flags = [p.requires_grad for p in every]
    for p in every:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    groups = [{"params": [p], "lr": lr * float(p.detach().pow(2).mean().sqrt().clamp_min(1e-8))} for p in params]
    opt = torch.optim.Adam(groups)
    warmup = max(1, steps // 10)  # Adam's first steps at full size throw a close start away
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    energy = float(y[train_idx].float().pow(2).mean())
    best, best_step, best_state = start, 0, _clone_state(attn)
    check_every = max(1, steps // 10)
    generator = torch.Generator().manual_seed(0)
    order = torch.empty(0, dtype=torch.long)
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            order = torch.cat((order, train_idx[torch.randperm(len(train_idx), generator=generator)]))
        idx, order = order[:batch_size], order[batch_size:]
        with torch.enable_grad():
            if pattern is None:
                out = _call(module, x[idx].float(), kw)
                loss = (out - y[idx].float()).pow(2).mean() / energy
            else:  # module is attn
                out, weights = _with_weights(module, x[idx].float(), kw)
                loss = (out - y[idx].float()).pow(2).mean() / energy + pattern.loss(weights, idx)
            loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        if step % check_every == 0 or step == steps:
            measured = held_in()
            if objective(measured) < objective(best):
                best, best_step, best_state = measured, step, _clone_state(attn)
    attn.load_state_dict(best_state)
    for p, flag in zip(every, flags):
        p.requires_grad_(flag)
    module.to(dtype)
    return best, best_step


def _call(module, x, kw) -> torch.Tensor:
    out = module(x, **kw)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def _error(attn, x, y, kw, batch_size) -> float:
    """E||A'(x) - y||^2 / E||y||^2 over the windows of x [m, T, D] (in float32 when the layer is)."""
    dtype = next(attn.parameters()).dtype
    num = den = 0.0
    for s in range(0, len(x), batch_size):
        out = _call(attn, x[s : s + batch_size].to(dtype), kw).float()
        num += float((out - y[s : s + batch_size].float()).pow(2).sum())
        den += float(y[s : s + batch_size].float().pow(2).sum())
    return num / max(den, 1e-300)


@torch.no_grad()
def _outputs(attn, x, kw, batch_size) -> torch.Tensor:
    return torch.cat([attn(x[s : s + batch_size], **kw)[0] for s in range(0, len(x), batch_size)])


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _clone_state(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@torch.no_grad()
def _inputs_of(module, run, x, batch_size, positional_ok: bool = True) -> tuple[torch.Tensor, dict]:
    """(the hidden states `module` receives while `run` processes x [n, ...] in batches, concatenated [n, T, D];
    its other arguments as given for a batch of one, so they broadcast over any batch). `run` stops at `module`."""
    seen, kwargs = [], {}

    def hook(target, args, kw):
        seen.append(args[0] if args else kw["hidden_states"])
        if not kwargs:
            kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
            if len(args) > 1 and not positional_ok:
                raise ValueError(f"{type(target).__name__} takes positional arguments beside the hidden states")
        raise _Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for s in range(0, len(x), batch_size):
            try:
                run(x[s : s + batch_size])
            except _Stop:
                pass
        kwargs.clear()
        try:  # the arguments for a batch of one
            run(x[:1])
        except _Stop:
            pass
    finally:
        handle.remove()
    return torch.cat(seen[:-1]), kwargs


def _first_layer_inputs(model, attn_name: str, windows, batch_size) -> tuple[torch.Tensor, dict]:
    """(residual stream entering the first decoder layer [n, T, D], that layer's other arguments: masks, positions,
    rotary embeddings)."""
    block = model.get_submodule(_parent(attn_name))
    return _inputs_of(block, lambda w: model(w, use_cache=False), windows, batch_size, positional_ok=False)


def _attention_inputs(block, attn, h, layer_kw, batch_size) -> tuple[torch.Tensor, dict]:
    """(the attention module's inputs [n, T, D] when `block` runs on h, its other arguments for a batch of one)."""
    return _inputs_of(attn, lambda x: block(x, **layer_kw), h, batch_size)


@torch.no_grad()
def _run_block(block, h, layer_kw, batch_size) -> torch.Tensor:
    outs = []
    for s in range(0, len(h), batch_size):
        out = block(h[s : s + batch_size], **layer_kw)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return torch.cat(outs)
