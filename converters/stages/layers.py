"""The layer loop: every decoder layer converted in the order the layers run, one source layer and its converted
layer resident at a time, then written into the output's shards and freed.

Carried tracks (hidden states [n, T, D] of the calibration windows at layer l's input, two buffers each):
    source:    the source's H_l (statistics, and the targets of the fits);
    converted: the converted prefix's H'_l (propagated calibration and reconstruction: reconstruct.fit_layer);
    export:    the converted prefix's H'_l one window at a time (the deepseek_v3 export's latent scales, measured
               on the native form as it runs window by window).
Per layer l: statistics of the source's attention input -> closed form -> propagate / reconstruct -> the export's
transform -> written. Peak memory: the resident parts (embeddings, norm, LM head) + ~2 layers + the carried buffers,
whatever the depth; the buffers stay on the device, in CPU memory or on disk (layer_stream.choose_placement).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ...kv_memory import dtype_of
from ..io.calibration import track_statistics
from ..io.layer_stream import BATCH, LayerRunner, Tracks
from ..io.layer_writer import ShardedWriter
from ..options import ConvertOptions
from ..fitting.reconstruct import LayerFit, fit_layer
from ..targets import target_of
from ..targets.base import LayerChoice, LayerResult, Target
from .closed_form import build_layer
from .source import Source

logger = logging.getLogger(__name__)


@dataclass
class LayersResult:
    """What the loop made: config (the converted model's), groups (GQA, per layer), choices / pairs / plans' retained
    energy (MLA, per layer), fits (propagate / reconstruct, per layer), activations (where the tracks lived)."""

    config: object
    groups: list = field(default_factory=list)
    pairs: list = field(default_factory=list)
    retained: list = field(default_factory=list)
    fits: list[LayerFit] = field(default_factory=list)
    activations: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    export: dict | None = None  # the report's "deepseek_v3" section
    native_config: object = None  # deepseek_v3: the native form's config (config: the export's)


def run_layers(
    source: Source,
    opts: ConvertOptions,
    target: Target,
    windows: torch.Tensor | None,
    choices: list[LayerChoice] | None,
    write,
    export=None,
    placement: str | None = None,
) -> LayersResult:
    """Convert every layer in order; write(name -> tensor dict) receives each converted layer's tensors.

    windows: calibration tokens [n, T] (None: no statistics needed); choices: MLA per-layer ranks / RoPE dims."""
    src, config, n_layers = source.layers, source.config, source.config.num_hidden_layers
    arch_split = source.shape.arch.split_heads
    names = (
        (["source"] if windows is not None else [])
        + (["converted"] if target.layerwise else [])
        + (["export"] if export is not None else [])
    )
    tracks, runners = None, {}
    if names:
        shape = (windows.shape[0], windows.shape[1], config.hidden_size)
        tracks = Tracks(names, shape, src.dtype, src.device, placement)
        runners = {BATCH: LayerRunner(src, windows.shape[1], BATCH), 1: LayerRunner(src, windows.shape[1], 1)}
        for name in names:
            runners[1 if name == "export" else BATCH].embed(windows, tracks[name].current)
    result = LayersResult(config=None)
    if tracks is not None:
        result.activations = {"placement": tracks.placement, "bytes": tracks.bytes, "tracks": names}
    seconds = {"statistics": 0.0, "closed_form": 0.0, "layerwise": 0.0, "export": 0.0, "read_write": 0.0}
    kind = target_of(opts.to)  # the target's hooks: closed form, relift, configs, what the report keeps
    configs = kind.layer_configs(config, opts, target, choices, source.shape.rotary_dim // 2)
    try:
        for i in range(n_layers):
            t = time.perf_counter()
            layer = src.layer(i)
            seconds["read_write"] += time.perf_counter() - t
            attn_name, attn = src.attention(layer)
            w = arch_split(attn).cpu()
            t = time.perf_counter()
            stats = (
                track_statistics(runners.get(BATCH), layer, attn, w, source.shape, i, tracks["source"])
                if windows is not None
                else None
            )
            seconds["statistics"] += time.perf_counter() - t
            t = time.perf_counter()
            choice = choices[i] if choices is not None else None
            first = kind.closed_form(opts, w, source.shape, stats, choice)
            new_config = configs.layer(i, first)
            converted = build_layer(layer, i, new_config, attn_name, first.state)
            seconds["closed_form"] += time.perf_counter() - t
            t = time.perf_counter()
            final = first
            if target.layerwise:
                final = _layerwise(
                    opts,
                    kind,
                    runners[BATCH],
                    layer,
                    converted,
                    f"{src.layers_name}.{i}.{attn_name}",
                    w,
                    source.shape,
                    choice,
                    first,
                    i,
                    tracks,
                    result,
                )
            seconds["layerwise"] += time.perf_counter() - t
            kind.record(result, first, final, choice)
            if tracks is not None and "source" in names:
                tracks["source"].swap()
            t = time.perf_counter()
            state = {f"{src.layers_name}.{i}.{k}": v for k, v in converted.state_dict().items()}
            if export is not None:
                state = export.layer(i, converted, new_config, runners[1], tracks["export"], state)
            seconds["export"] += time.perf_counter() - t
            t = time.perf_counter()
            write(state)
            seconds["read_write"] += time.perf_counter() - t
            del layer, converted, attn, w, stats, state
        if export is not None:
            result.export = export.report(tracks["export"].current)
    finally:
        if tracks is not None:
            tracks.close()
    result.config = configs.final()
    result.pairs = configs.pairs
    result.seconds = {k: round(v, 3) for k, v in seconds.items()}
    return result


def _layerwise(
    opts,
    kind,
    runner: LayerRunner,
    layer,
    converted,
    name: str,
    w,
    shape,
    choice,
    first: LayerResult,
    i: int,
    tracks: Tracks,
    result: LayersResult,
) -> LayerResult:
    """Propagate (recompute the closed form from the converted prefix's statistics, kept if better held-in) and / or
    reconstruct layer i in place (reconstruct.fit_layer); then advance the converted track through it."""
    kept = {"result": first}
    relift = None
    if opts.calibration.propagate and opts.method != "mean":

        def relift(name, stats):  # noqa: E306
            kept["result"] = kind.relift(opts, w, shape, stats, choice, first)
            return kept["result"].state

    h_src, h_new = tracks["source"].current, tracks["converted"].current
    kw = runner.layer_kwargs(i)
    rec = opts.reconstruction
    fit = fit_layer(
        name,
        layer,
        converted,
        h_src,
        h_new,
        kw,
        kw,
        shape,
        relift=relift,
        steps=rec.steps,
        lr=rec.lr,
        batch_size=BATCH,
        target=rec.target,
        attention_kl=rec.attention_kl,
    )
    result.fits.append(fit)
    runner.apply(converted, i, tracks["converted"].current, tracks["converted"].spare)
    tracks["converted"].swap()
    return kept["result"] if fit.propagated_kept else first


def convert_layers(
    source: Source,
    opts: ConvertOptions,
    target: Target,
    windows: torch.Tensor | None,
    plan,
    write,
    native: bool = False,
) -> LayersResult:
    """The layer loop, the resident parts (embeddings, final norm, LM head unless tied) written after it, and the
    config of what was written (`result.config`: the deepseek_v3 export's, unless `native`: the native form, which
    healing loads whole)."""
    from .export import LayerExport

    src = source.layers
    export = None
    if opts.format == "deepseek_v3" and not native:
        mode = "fit" if (dtype_of(opts.dtype) if opts.dtype is not None else src.dtype) == torch.float16 else "linear"
        export = LayerExport(src, opts.engine, target.export_rope, mode, plan.stride, windows)
    result = run_layers(source, opts, target, windows, plan.choices, write, export)
    if export is not None:
        write(export.resident())
        result.native_config, result.config = result.config, export.config
        return result
    write(src.resident_state())
    if target.stock_format and not native:
        del result.config.attention_variant  # a plain config: our module's weight names are the stock ones
    return result


def write_native(
    source: Source, opts: ConvertOptions, target: Target, windows: torch.Tensor | None, plan, folder
) -> LayersResult:
    """The native converted model written into `folder` (for healing, or an export, to load whole)."""
    with ShardedWriter(folder, opts.output.max_shard_size) as writer:
        layers = convert_layers(source, opts, target, windows, plan, writer.add, native=True)
        writer.finish(layers.config, source.generation_config)
    return layers
