"""The in-memory conversion as the library ran it before layer streaming: the whole source and the whole converted
model resident (one model forward per calibration batch, reconstruction and sensitivity by hooks on the whole
model). The streamed pipeline's outputs are compared with it tensor by tensor (tests/test_streamed_*.py).

A frozen copy: it imports only library functions whose math the streamed pipeline shares unchanged
(closed forms, statistics accumulation, the per-layer fits, the deepseek_v3 export of a whole model); everything the
streamed stages decide (sizes, steps, the whole-model statistics, the one-rank MLA layer) is its own, so a
regression there shows up as a difference."""

from __future__ import annotations

import functools
import logging
import time
from types import SimpleNamespace

import torch
from torch import nn

from tqdm.auto import tqdm

from hf_attn_patch.attention import MultiHeadLatentAttention
from hf_attn_patch.converters.export.deepseek_export import check_source, engine_shape, to_deepseek_v3
from hf_attn_patch.converters.export.stock_rope import stock_frequencies
from hf_attn_patch.converters.fitting.reconstruct import LAYERWISE_LR, sequential, summary
from hf_attn_patch.converters.io.calibration import (
    LayerStats,
    StatsAccumulator,
    calibration_windows,
    read_calibration_text,
    teacher_windows,
)
from hf_attn_patch.converters.methods.budgets import (
    MEASURE_TOKENS,
    Candidate,
    budget_values,
    candidate_grid,
    choose,
    exact_plan,
    mla_module,
)
from hf_attn_patch.converters.methods.exact import rebuild, stock_attention_layers
from hf_attn_patch.converters.methods.gqa_merge import gqa_layer
from hf_attn_patch.converters.methods.mla_plan import (
    LatentPlan,
    allocate_ranks,
    lift_plan,
    plan_layer,
    ranked_components,
)
from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.devices import resolve_device
from hf_attn_patch.hub import engines
from hf_attn_patch.kv_memory import dtype_of, kv_cache_bytes
from hf_attn_patch.models import fast_linear
from hf_attn_patch.models.architectures import AttentionShape, AttentionWeights, architecture_of, head_dim, rotary_dim
from hf_attn_patch.models.pretrained import load_source

logger = logging.getLogger(__name__)
STOCK_GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
AUTO_RECONSTRUCT_STEPS = (60, 150)


def _flat_options(**options) -> SimpleNamespace:
    """The options validated by the library, as flat names (mutable, as the in-memory path mutated them)."""
    return SimpleNamespace(**ConvertOptions.from_flat(**options).flat())


@fast_linear.disabled()  # the kernels convert() runs: torch's F.linear
def convert_in_memory(source: str, **options):
    """(converted model, report): the in-memory conversion as it was before streaming (nothing written)."""
    opts = _flat_options(**options)
    started = time.perf_counter()
    torch.manual_seed(opts.seed)
    model, tokenizer = load_source(source)
    model.to(resolve_device(opts.device))  # in memory only: the source checkpoint is never written
    config = model.config
    arch, dims = architecture_of(config), AttentionShape.of(config)  # the shape the methods read
    if arch.replaces_stock:
        raise ValueError(f"model_type={config.model_type!r} is already MLA: there is nothing to convert")
    layers = stock_attention_layers(model)
    d_h = head_dim(config)
    source_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    report = {
        "source": str(source),
        "options": dict(vars(opts)),
        "given_options": dict(options),
        "model_type": config.model_type,
    }
    text = functools.cache(lambda: read_calibration_text(opts.calib_data, opts.calib_split, opts.calib_column))
    stock_format = opts.format == "stock" or (
        opts.format == "auto" and opts.to != "mla" and config.model_type in STOCK_GQA_TYPES
    )
    if stock_format and config.model_type not in STOCK_GQA_TYPES:
        raise ValueError(f"format='stock' exists for GQA/MQA of {STOCK_GQA_TYPES} only, not {config.model_type!r}")

    if opts.to in ("gqa", "mqa"):
        if source_kv % opts.kv_heads:
            raise ValueError(f"kv_heads={opts.kv_heads} must divide the source's num_key_value_heads={source_kv}")
        if opts.method != "mean" and arch.split_heads(next(iter(layers.values()))).q_norm is not None:
            if options.get("method") is not None:  # asked for by name: refused before calibrating
                raise ValueError(
                    f"method={opts.method!r} with per-head q/k norms ({config.model_type}) is not "
                    f"supported: use method='mean'"
                )
            logger.warning(
                "%s has per-head q/k norms: the default %r does not apply, using 'mean'", config.model_type, opts.method
            )
            opts.method = report["options"]["method"] = "mean"
        _resolve_reconstruct_steps(opts, report, opts.kv_heads / source_kv)
        layerwise = opts.reconstruct_steps or (opts.propagate and opts.method != "mean")
        windows, stats = (
            _calibrate(model, tokenizer, text(), opts, report) if opts.method != "mean" or layerwise else (None, {})
        )
        lifted, groups = {}, []
        for name, m in layers.items():
            lifted[name], layer_groups = gqa_layer(
                opts.method, arch.split_heads(m).cpu(), dims, opts.kv_heads, stats.get(name), regroup=opts.regroup
            )
            groups.append(layer_groups)
        new = rebuild(model, "gqa", {"num_key_value_heads": opts.kv_heads}, lifted)
        report["kv_heads"] = {"before": source_kv, "after": opts.kv_heads, "groups_per_layer": groups}
        if layerwise:
            index = {name: i for i, name in enumerate(layers)}

            def relift(name, layer_stats):  # the same merge from the converted prefix's statistics
                state, groups[index[name]] = gqa_layer(
                    opts.method,
                    arch.split_heads(layers[name]).cpu(),
                    dims,
                    opts.kv_heads,
                    layer_stats,
                    regroup=opts.regroup,
                )
                return state

            _layerwise(model, new, windows, relift if opts.propagate and opts.method != "mean" else None, opts, report)
    else:
        deepseek = opts.format == "deepseek_v3"
        shape = None
        if deepseek:  # before any work: the source, then the engine's shapes
            check_source(config)
            shape = engine_shape(opts.engine, config, opts.kv_budget, opts.kv_lora_rank, opts.rope_dim)
        if shape is None:
            rope_dim, kv_lora_rank = _mla_sizes(opts, config, source_kv, d_h)
            export_rope = rope_dim
        else:  # the conversion keeps at most the source's frequencies; the export pads with zero RoPE pairs
            kv_lora_rank, export_rope = shape
            rope_dim = min(export_rope, rotary_dim(config))
        _resolve_reconstruct_steps(opts, report, (export_rope + kv_lora_rank) / (2 * source_kv * d_h))
        if deepseek:
            check_source(config, rope_dim)
        sensitivity = opts.rank_allocation == "sensitivity"
        context = opts.rope_context  # the RoPE score's L (the options fill in calib_len)
        if sensitivity:  # the candidate grid is checked against the budget before calibrating
            candidate_grid(dims, opts.kv_budget, opts.rope_dim)
        windows, stats = _calibrate(model, tokenizer, text(), opts, report)
        weights = {name: arch.split_heads(module).cpu() for name, module in layers.items()}
        frequencies = stride = None
        rope_dims = [rope_dim] * len(weights)
        if sensitivity:  # per-layer RoPE dims and ranks (or the exact layer) by measured KL
            plans, ranks, rope_dims, report["budgets"] = allocate(
                model, layers, weights, stats, windows, config, opts.kv_budget, opts.method, context, opts.rope_dim
            )
        else:
            ranked = {
                name: ranked_components(opts.method, w, dims, stats[name], context) if rope_dim else None
                for name, w in weights.items()
            }
            if deepseek:  # one component per frequency 0, s, 2s, ...: the frequencies a stock RoPE key can turn at
                frequencies, stride = stock_frequencies(list(ranked.values()), rotary_dim(config) // 2, rope_dim // 2)
            plans = {
                name: plan_layer(
                    opts.method, w, dims, stats[name], rope_dim, frequencies=frequencies, ranked=ranked[name]
                )
                for name, w in weights.items()
            }
        per_layer = opts.rank_allocation != "uniform"
        if not sensitivity:
            ranks = (
                allocate_ranks(list(plans.values()), kv_lora_rank * len(plans))
                if per_layer
                else [kv_lora_rank] * len(plans)
            )
        lifted, per_layer_pairs, fields = {}, [], {}
        for (name, plan), rank in zip(plans.items(), ranks):
            lifted[name], fields = lift_plan(plan, weights[name], dims, rank)
            per_layer_pairs.append(fields["mla_rope_pairs"])
        fields["mla_rope_pairs"] = per_layer_pairs if max(rope_dims) else None
        fields["kv_lora_rank"] = max(ranks)
        fields["qk_rope_head_dim"] = max(rope_dims)
        if per_layer:
            fields["mla_kv_lora_ranks"] = ranks
        if sensitivity:
            fields["mla_qk_rope_head_dims"] = rope_dims
        new = rebuild(model, "mla", fields, lifted)
        report["mla"] = {"kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": max(rope_dims),
                         "qk_rope_head_dim_per_layer": rope_dims,
                         "qk_nope_head_dim": fields["qk_nope_head_dim"], "rope_pairs_per_layer": per_layer_pairs,
                         "kv_lora_rank_per_layer": ranks,
                         "retained_energy_per_layer": [round(p.retained(r), 4) for p, r in zip(plans.values(), ranks)]}  # fmt: skip
        if opts.propagate or opts.reconstruct_steps:
            index = {name: i for i, name in enumerate(layers)}

            def relift(name, layer_stats):  # same ranks and RoPE frequencies, from the converted prefix's statistics
                freqs, layer_rope = per_layer_pairs[index[name]] or [], rope_dims[index[name]]
                exact = sensitivity and report["budgets"]["layers"][index[name]]["choice"] != "mla"
                plan = (
                    plans[name]
                    if exact
                    else plan_layer(
                        opts.method,
                        weights[name],
                        dims,
                        layer_stats,
                        layer_rope,
                        context,
                        frequencies=freqs if layer_rope else None,
                    )
                )
                return lift_plan(plan, weights[name], dims, ranks[index[name]])[0]

            _layerwise(model, new, windows, relift if opts.propagate else None, opts, report)

    if opts.heal_steps and opts.heal_layerwise_steps:  # healing's first stage, layer by layer, on the native form
        if windows is None:
            windows = calibration_windows(text(), tokenizer, opts.calib_samples, opts.calib_len)
        report["heal_layerwise"] = heal_layerwise(model, new, windows, opts.heal_layerwise_steps)
    if opts.heal_steps:
        raise NotImplementedError("the reference covers conversion without end-to-end healing")
    if opts.format == "deepseek_v3":  # after healing, on the native form: the export's scaled latent rows (~1e-8)
        # would not survive optimizer steps sized for the other weights
        final_dtype = dtype_of(opts.dtype) if opts.dtype is not None else next(model.parameters()).dtype
        new, report["deepseek_v3"] = to_deepseek_v3(
            new, windows, stride, config, opts.engine, export_rope, "fit" if final_dtype == torch.float16 else "linear"
        )

    if stock_format:
        del new.config.attention_variant  # a plain config: our module's weight names are the stock ones
    if opts.dtype is not None:
        new = new.to(dtype_of(opts.dtype))
    report["format"] = "stock" if stock_format else opts.format if opts.format == "deepseek_v3" else "native"
    report["engines"] = engines(report)  # where the export was run (tested) and where only in theory
    report["kv_bytes_per_token_fp16"] = {
        "before": kv_cache_bytes(config, 1),
        "after": kv_cache_bytes(new.config, 1),
    }
    report["kv_ratio"] = report["kv_bytes_per_token_fp16"]["after"] / report["kv_bytes_per_token_fp16"]["before"]
    report["wall_time_s"] = round(time.perf_counter() - started, 3)
    return new, report


def auto_reconstruct_steps(kv_share: float) -> int:
    """reconstruct_steps="auto": AUTO_RECONSTRUCT_STEPS[0] when the conversion keeps at least half the source's KV
    values per token (kv_share >= 0.5), AUTO_RECONSTRUCT_STEPS[1] below."""
    return AUTO_RECONSTRUCT_STEPS[0] if kv_share >= 0.5 else AUTO_RECONSTRUCT_STEPS[1]


def _resolve_reconstruct_steps(opts: SimpleNamespace, report: dict, kv_share: float) -> None:
    if opts.reconstruct_steps == "auto":
        opts.reconstruct_steps = report["options"]["reconstruct_steps"] = auto_reconstruct_steps(kv_share)
        logger.info("reconstruct_steps auto: %d (KV share %.3g)", opts.reconstruct_steps, kv_share)


def _calibrate(model, tokenizer, text: str, opts: SimpleNamespace, report: dict) -> tuple[torch.Tensor, dict]:
    """(calibration windows, activation statistics of every attention layer) (recorded in the report)."""
    windows = calibration_windows(text, tokenizer, opts.calib_samples, opts.calib_len)
    if opts.calib_source == "teacher":
        windows = teacher_windows(model, windows, seed=opts.seed)
    report["calibration"] = {"data": opts.calib_data or "package corpus (TinyStories sample)",
                             "source": opts.calib_source, "split": opts.calib_split, "column": opts.calib_column,
                             "samples": opts.calib_samples, "length": opts.calib_len}  # fmt: skip
    return windows, collect_stats(model, windows)


def _layerwise(model, new, windows: torch.Tensor, relift, opts: SimpleNamespace, report: dict) -> None:
    """Propagated calibration and / or reconstruction of every converted layer of `new`, in place (reconstruct.py)."""
    fits = sequential(
        model,
        new,
        windows,
        relift=relift,
        steps=opts.reconstruct_steps,
        lr=opts.reconstruct_lr,
        target=opts.reconstruct_target,
        attention_kl=opts.reconstruct_attention_kl,
    )
    report["layerwise"] = {"propagate": relift is not None, "reconstruct_steps": opts.reconstruct_steps,
                           "target": opts.reconstruct_target, "attention_kl": opts.reconstruct_attention_kl,
                           **summary(fits)}  # fmt: skip


def heal_layerwise(teacher, student, windows: torch.Tensor, steps: int) -> dict:
    """Healing's first stage (reconstruct target "block"): every attention layer of `student` fitted, layer by layer,
    so that its decoder layer's output matches the teacher's on the calibration windows; a summary for the report."""
    fits = sequential(teacher, student, windows, steps=steps, lr=LAYERWISE_LR, target="block")
    return {"steps": steps, "lr": LAYERWISE_LR, **summary(fits)}


def _mla_sizes(opts: SimpleNamespace, config, source_kv: int, d_h: int) -> tuple[int, int]:
    """(rope_dim, kv_lora_rank) from the options, checked against the source."""
    arch = architecture_of(config)
    max_rope = source_kv * rotary_dim(config) if arch.rotary else 0
    budget = None if opts.kv_budget is None else int(round(opts.kv_budget * 2 * source_kv * d_h))  # values/token
    default_rope = min(d_h, max_rope) if budget is None else min(d_h, max_rope, 2 * (budget // 6))  # <= 1/3 of it
    rope_dim = opts.rope_dim if opts.rope_dim is not None else default_rope
    if rope_dim > max_rope:
        raise ValueError(f"rope_dim={rope_dim} exceeds the source's {max_rope} RoPE dims (KV heads x rotary dims)")
    if opts.kv_lora_rank is not None:
        return rope_dim, opts.kv_lora_rank
    if budget - rope_dim < 1:
        raise ValueError(
            f"kv_budget={opts.kv_budget} gives {budget} values per token: no room beside rope_dim={rope_dim}"
        )
    return rope_dim, budget - rope_dim


class _Skip(nn.Module):
    """Stands in for a decoder layer before the one measured: its input passes through unchanged."""

    def __init__(self, layer: nn.Module, as_tuple: bool):
        super().__init__()
        self.as_tuple = as_tuple
        if hasattr(layer, "attention_type"):  # masks are picked by it (sliding-window models)
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.as_tuple else hidden_states


@torch.no_grad()
def measure(model, layers: dict[str, nn.Module], lifts, windows: torch.Tensor) -> list[list[float]]:
    """kl[l][k]: KL(source || source with layer l's attention replaced by lifts(l, k)) per token, on `windows`.

    lifts: (layer index, candidate index) -> an attention module (counts: candidates per layer; is_exact(l, k):
    the layer's exact form, KL 0 by construction, not run). The residual stream entering each layer is cached from
    one source forward; a measurement runs the model with the layers before l skipped and layer l's input replaced
    by the cache."""
    names = list(layers)
    windows = windows.to(next(model.parameters()).device)
    blocks = [model.get_submodule(_parent(n)) for n in names]
    container = model.get_submodule(_parent(_parent(names[0])))
    inputs, out_types = [], []
    hooks = [
        b.register_forward_pre_hook(
            lambda m, a, kw: inputs.append(a[0] if a else kw["hidden_states"]), with_kwargs=True
        )
        for b in blocks
    ]
    hooks.append(blocks[0].register_forward_hook(lambda m, a, out: out_types.append(isinstance(out, tuple))))
    try:
        reference = torch.log_softmax(model(windows, use_cache=False).logits.float(), dim=-1)
        probs = reference.exp()  # once, not once per candidate (the same values)
    finally:
        for h in hooks:
            h.remove()
    skippable = isinstance(container, nn.ModuleList) and all(container[i] is b for i, b in enumerate(blocks))
    kl = [[] for _ in names]
    todo = [(l, k) for l in range(len(names)) for k in range(lifts.counts[l])]
    for l, k in todo:
        if lifts.is_exact(l, k):
            kl[l].append(0.0)
            continue
        parent, attr = _parent(names[l]), names[l].rsplit(".", 1)[1]
        source_attn = layers[names[l]]
        setattr(model.get_submodule(parent), attr, lifts(l, k).to(windows.device))
        replace = blocks[l].register_forward_pre_hook(
            lambda m, a, kw, h=inputs[l]: _with_input(a, kw, h), with_kwargs=True
        )
        if skippable:
            for i in range(l):
                container[i] = _Skip(blocks[i], out_types[0])
        try:
            logq = torch.log_softmax(model(windows, use_cache=False).logits.float(), dim=-1)
        finally:
            replace.remove()
            setattr(model.get_submodule(parent), attr, source_attn)
            if skippable:
                for i in range(l):
                    container[i] = blocks[i]
        kl[l].append(float((probs * (reference - logq)).sum(-1).mean()))
    return kl


def _with_input(args, kwargs, hidden):
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class _Lifts:
    """Builds (and caches the plans of) every candidate of every layer: plans per (layer, rope_dim)."""

    def __init__(self, weights, config, stats, method, context, grid):
        self.weights, self.config, self.stats, self.method, self.context = weights, config, stats, method, context
        self.names = list(weights)
        self.shape = AttentionShape.of(config)
        self.exact = [exact_plan(weights[n], self.shape) for n in self.names]
        self.grid = [
            [c for c in grid if c.values < len(e.energy) + len(e.components) * 2]
            + [Candidate(2 * len(e.components), len(e.energy), exact=True)]
            for e in self.exact
        ]
        self.counts = [len(g) for g in self.grid]
        self.is_exact = lambda l, k: self.grid[l][k].exact
        self._plans, self._ranked = {}, {}

    def plan(self, l: int, cand: Candidate) -> LatentPlan:
        if cand.exact:
            return self.exact[l]
        key = (l, cand.rope_dim)
        if key not in self._plans:
            name = self.names[l]
            if l not in self._ranked and cand.rope_dim:
                self._ranked[l] = ranked_components(
                    self.method, self.weights[name], self.shape, self.stats[name], self.context
                )
            self._plans[key] = plan_layer(
                self.method,
                self.weights[name],
                self.shape,
                self.stats[name],
                cand.rope_dim,
                self.context,
                ranked=self._ranked.get(l),
            )
        return self._plans[key]

    def __call__(self, l: int, k: int) -> MultiHeadLatentAttention:
        cand = self.grid[l][k]
        state, fields = lift_plan(self.plan(l, cand), self.weights[self.names[l]], self.shape, cand.rank)
        return mla_module(state, fields, self.config, l, fields["mla_rope_pairs"])


def allocate(
    model,
    layers: dict[str, nn.Module],
    weights: dict[str, AttentionWeights],
    stats: dict,
    windows,
    config,
    kv_budget: float,
    method: str,
    context: int,
    rope_dim: int | None = None,
):
    """(plans {name: LatentPlan}, ranks [L], rope dims [L], report section) within the kv_budget, by measured KL.

    The plans and ranks feed methods.lift_plan as the other allocations do (an unconverted layer's plan is its
    exact form at full rank)."""
    started = time.process_time()
    total = budget_values(AttentionShape.of(config), kv_budget)
    grid = candidate_grid(AttentionShape.of(config), kv_budget, rope_dim)
    lifts = _Lifts(weights, config, stats, method, context, grid)
    count = max(1, MEASURE_TOKENS // windows.shape[1])
    kl = measure(model, layers, lifts, windows[:count])
    options = [[(c.values, kl[l][k]) for k, c in enumerate(lifts.grid[l])] for l in range(len(kl))]
    chosen = choose(options, total)
    picks = [lifts.grid[l][k] for l, k in enumerate(chosen)]
    plans = {name: lifts.plan(l, c) for l, (name, c) in enumerate(zip(lifts.names, picks))}
    used = sum(c.values for c in picks)
    report = {
        "allocation": "sensitivity",
        "budget_values_per_token": total,
        "values_per_token": used,
        "budget_bytes_per_token_fp16": 2 * total,
        "bytes_per_token_fp16": 2 * used,
        "windows": min(count, len(windows)),
        "summed_kl": sum(kl[l][k] for l, k in enumerate(chosen)),
        "cpu_seconds": round(time.process_time() - started, 2),
        "layers": [{"layer": l, "choice": "unconverted (exact MLA)" if c.exact else "mla", "rope_dim": c.rope_dim,
                    "kv_lora_rank": c.rank, "values_per_token": c.values, "kl": kl[l][chosen[l]]}
                   for l, c in enumerate(picks)],
        "measured": [[{"rope_dim": c.rope_dim, "kv_lora_rank": c.rank, "exact": c.exact, "kl": kl[l][k]}
                      for k, c in enumerate(lifts.grid[l])] for l in range(len(kl))],
    }  # fmt: skip
    logger.info(
        "sensitivity allocation: %d of %d KV values per token, summed KL %.4g", used, total, report["summed_kl"]
    )
    return plans, [c.rank for c in picks], [c.rope_dim for c in picks], report


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0]


# -- the in-memory path's statistics and one-rank MLA layer (the streamed conversion has its own) ----------------


class _Done(Exception):
    """Raised by the last attention layer's hook: its statistics are in."""


@torch.no_grad()
def collect_stats(model, windows: torch.Tensor, progress: bool = True) -> dict[str, LayerStats]:
    """Run the whole source model on the windows and gather LayerStats for every stock attention layer (the
    streamed conversion gathers them layer by layer: calibration.track_statistics)."""
    arch = architecture_of(model.config)
    layers = stock_attention_layers(model)
    acc = {name: StatsAccumulator(arch.split_heads(m), AttentionShape.of(model.config)) for name, m in layers.items()}

    last = list(layers)[-1]

    def make_hook(name):
        def hook(module, args, kwargs):
            acc[name].add(args[0] if args else kwargs["hidden_states"])
            if name == last:  # the rest of the forward (the last layer, the LM head) is not needed
                raise _Done

        return hook

    handles = [m.register_forward_pre_hook(make_hook(name), with_kwargs=True) for name, m in layers.items()]
    try:
        for start in tqdm(range(0, len(windows), 4), desc="calibration", disable=not progress):
            try:
                model(windows[start : start + 4].to(model.device), use_cache=False)
            except _Done:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: a.stats() for name, a in acc.items() if a.n}


def mla_layer(
    method: str,
    w: AttentionWeights,
    config,
    stats: LayerStats,
    kv_lora_rank: int,
    rope_dim: int,
    context: int = 256,
    frequencies: list[int] | None = None,
):
    """(state dict, config fields) of one MLA layer by `method`, one rank (plan_layer + lift_plan)."""
    shape = AttentionShape.of(config)
    return lift_plan(plan_layer(method, w, shape, stats, rope_dim, context, frequencies), w, shape, kv_lora_rank)
