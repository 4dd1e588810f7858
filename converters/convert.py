"""`convert()`: a checkpoint in, a GQA / MQA / MLA checkpoint out, optionally healed by distillation.

Steps: validate every option (before any weight loads) -> load the source (never modified) -> calibrate when the
method needs activations -> re-express each attention layer -> heal (optional) -> write to a temporary folder,
rename when complete.
The output holds safetensors weights, the tokenizer, the generation config, conversion_report.json and a model card.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ..devices import resolve_device
from ..extras import available
from ..kv_memory import dtype_of, kv_cache_bytes
from ..models.architectures import architecture_of, head_dim, rotary_dim
from ..models.pretrained import DEFAULT_MODEL_DIR
from .calibration import calibration_windows, collect_stats, read_calibration_text, teacher_windows
from .deepseek_export import check_source, engine_shape, stock_frequencies, to_deepseek_v3
from .budgets import allocate, candidate_grid
from .exact import rebuild, stock_attention_layers
from .hub import engines, model_card, push
from .gqa_merge import gqa_layer
from .heal import plot_curve
from .options import ConvertOptions
from .reconstruct import LAYERWISE_LR, sequential, summary
from .methods import allocate_ranks, lift_plan, plan_layer, ranked_components

logger = logging.getLogger(__name__)

STOCK_GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # configs with a native num_key_value_heads
# reconstruct_steps "auto" (the CLI's default): steps per layer when the conversion keeps >= half the source's KV
# values, and below: there the closed form starts further off and 60 steps end with most layers still improving
# (SmolLM2 MQA 3->1 / MLA 25%, held-in teacher KL, docs/research-log.md)
AUTO_RECONSTRUCT_STEPS = (60, 150)


def load_source(source: str):
    """(model, tokenizer): 'default' (embedded stories260k), 'smollm2', a local folder (safetensors only), or a Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models import load_default, load_smollm2

    if source == "default":
        return load_default()
    if source == "smollm2":
        return load_smollm2()
    check_source_folder(source)
    try:  # use_safetensors: a folder holding only pickled .bin weights is refused, never unpickled
        model = AutoModelForCausalLM.from_pretrained(source, use_safetensors=True).eval()
    except OSError as err:
        raise ValueError(f"{source!r} is not a model folder, 'default', 'smollm2' or a reachable Hub id ({err})") from err
    return model, AutoTokenizer.from_pretrained(source)


def convert(source: str, out: str | os.PathLike, hub_client=None, **options) -> dict:
    """Convert `source` and write the result to `out`; returns the conversion report (also in the output folder).
    With push_to_hub="owner/name" the finished folder is uploaded (`hub_client`: a huggingface_hub.HfApi stand-in)."""
    opts = ConvertOptions.from_flat(**options)
    out = Path(out)
    check_output(source, out, opts.output.overwrite)  # the source folder is checked by load_source, before any weight
    started = time.perf_counter()
    torch.manual_seed(opts.seed)
    model, tokenizer = load_source(source)
    model.to(resolve_device(opts.device))  # in memory only: the source checkpoint is never written
    config = model.config
    arch = architecture_of(config)
    if arch.replaces_stock:
        raise ValueError(f"model_type={config.model_type!r} is already MLA: there is nothing to convert")
    layers = stock_attention_layers(model)
    d_h = head_dim(config)
    source_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    report = {"source": str(source), "options": opts.flat(), "given_options": dict(options),
              "model_type": config.model_type}
    calib = opts.calibration
    text = functools.cache(lambda: read_calibration_text(calib.data, calib.split, calib.column))
    stock_format = opts.format == "stock" or (opts.format == "auto" and opts.to != "mla"
                                              and config.model_type in STOCK_GQA_TYPES)  # fmt: skip
    if stock_format and config.model_type not in STOCK_GQA_TYPES:
        raise ValueError(f"format='stock' exists for GQA/MQA of {STOCK_GQA_TYPES} only, not {config.model_type!r}")

    if opts.to in ("gqa", "mqa"):
        if source_kv % opts.kv_heads:
            raise ValueError(f"kv_heads={opts.kv_heads} must divide the source's num_key_value_heads={source_kv}")
        if opts.method != "mean" and arch.split_heads(next(iter(layers.values()))).q_norm is not None:
            if options.get("method") is not None:  # asked for by name: refused before calibrating
                raise ValueError(f"method={opts.method!r} with per-head q/k norms ({config.model_type}) is not "
                                 f"supported: use method='mean'")  # fmt: skip
            logger.warning("%s has per-head q/k norms: the default %r does not apply, using 'mean'",
                           config.model_type, opts.method)  # fmt: skip
            opts.method = report["options"]["method"] = "mean"
        _resolve_reconstruct_steps(opts, report, opts.kv_heads / source_kv)
        layerwise = opts.reconstruction.steps or (opts.calibration.propagate and opts.method != "mean")
        windows, stats = (_calibrate(model, tokenizer, text(), opts, report) if opts.method != "mean" or layerwise
                          else (None, {}))  # fmt: skip
        lifted, groups = {}, []
        for name, m in layers.items():
            lifted[name], layer_groups = gqa_layer(opts.method, arch.split_heads(m).cpu(), config, opts.kv_heads,
                                                   stats.get(name), regroup=opts.regroup)  # fmt: skip
            groups.append(layer_groups)
        new = rebuild(model, "gqa", {"num_key_value_heads": opts.kv_heads}, lifted)
        report["kv_heads"] = {"before": source_kv, "after": opts.kv_heads, "groups_per_layer": groups}
        if layerwise:
            index = {name: i for i, name in enumerate(layers)}

            def relift(name, layer_stats):  # the same merge from the converted prefix's statistics
                state, groups[index[name]] = gqa_layer(opts.method, arch.split_heads(layers[name]).cpu(), config,
                                                       opts.kv_heads, layer_stats, regroup=opts.regroup)  # fmt: skip
                return state

            propagate = opts.calibration.propagate and opts.method != "mean"
            _layerwise(model, new, windows, relift if propagate else None, opts, report)
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
        if sensitivity:  # the candidate grid is checked against the budget before calibrating
            candidate_grid(config, opts.kv_budget, opts.rope_dim)
        windows, stats = _calibrate(model, tokenizer, text(), opts, report)
        weights = {name: arch.split_heads(module).cpu() for name, module in layers.items()}
        frequencies = stride = None
        rope_dims = [rope_dim] * len(weights)
        if sensitivity:  # per-layer RoPE dims and ranks (or the exact layer) by measured KL
            plans, ranks, rope_dims, report["budgets"] = allocate(
                model, layers, weights, stats, windows, config, opts.kv_budget, opts.method, opts.calibration.length,
                opts.rope_dim)  # fmt: skip
        else:
            ranked = {name: ranked_components(opts.method, w, config, stats[name], opts.calibration.length) if rope_dim
                      else None for name, w in weights.items()}  # fmt: skip
            if deepseek:  # one component per frequency 0, s, 2s, ...: the frequencies a stock RoPE key can turn at
                frequencies, stride = stock_frequencies(list(ranked.values()), rotary_dim(config) // 2, rope_dim // 2)
            plans = {name: plan_layer(opts.method, w, config, stats[name], rope_dim, frequencies=frequencies,
                                      ranked=ranked[name]) for name, w in weights.items()}  # fmt: skip
        per_layer = opts.rank_allocation != "uniform"
        if not sensitivity:
            ranks = (allocate_ranks(list(plans.values()), kv_lora_rank * len(plans)) if per_layer
                     else [kv_lora_rank] * len(plans))  # fmt: skip
        lifted, per_layer_pairs, fields = {}, [], {}
        for (name, plan), rank in zip(plans.items(), ranks):
            lifted[name], fields = lift_plan(plan, weights[name], config, rank)
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
        if opts.calibration.propagate or opts.reconstruction.steps:
            index = {name: i for i, name in enumerate(layers)}

            def relift(name, layer_stats):  # same ranks and RoPE frequencies, from the converted prefix's statistics
                freqs, layer_rope = per_layer_pairs[index[name]] or [], rope_dims[index[name]]
                exact = sensitivity and report["budgets"]["layers"][index[name]]["choice"] != "mla"
                plan = plans[name] if exact else plan_layer(opts.method, weights[name], config, layer_stats, layer_rope,
                                                            opts.calibration.length,
                                                            frequencies=freqs if layer_rope else None)  # fmt: skip
                return lift_plan(plan, weights[name], config, ranks[index[name]])[0]

            _layerwise(model, new, windows, relift if opts.calibration.propagate else None, opts, report)

    if opts.healing.steps and opts.healing.layerwise_steps:  # healing's first stage, layer by layer, on the native form
        if windows is None:
            windows = calibration_windows(text(), tokenizer, opts.calibration.samples, opts.calibration.length)
        report["heal_layerwise"] = heal_layerwise(model, new, windows, opts.healing.layerwise_steps)
    if opts.healing.steps:
        report["heal"] = _heal(new, model, tokenizer, text(), opts,
                               windows if opts.calibration.source == "teacher" else None)  # fmt: skip
    if opts.format == "deepseek_v3":  # after healing, on the native form: the export's scaled latent rows (~1e-8)
        # would not survive optimizer steps sized for the other weights
        final_dtype = dtype_of(opts.dtype) if opts.dtype is not None else next(model.parameters()).dtype
        new, report["deepseek_v3"] = to_deepseek_v3(new, windows, stride, config, opts.engine, export_rope,
                                                    "fit" if final_dtype == torch.float16 else "linear")  # fmt: skip

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
    report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if not _is_main_process():  # under torchrun / accelerate launch every process converts and heals; one writes
        return report
    _write_atomically(new, tokenizer, report, out, opts.output.max_shard_size)
    logger.info("converted %s -> %s (%s, %s)", source, out, opts.to, opts.method)
    if opts.output.push_to_hub is not None:
        report["hub"] = push(out, opts.output.push_to_hub, private=opts.output.private, client=hub_client)
    return report


def auto_reconstruct_steps(kv_share: float) -> int:
    """reconstruct_steps="auto": AUTO_RECONSTRUCT_STEPS[0] when the conversion keeps at least half the source's KV
    values per token (kv_share >= 0.5), AUTO_RECONSTRUCT_STEPS[1] below."""
    return AUTO_RECONSTRUCT_STEPS[0] if kv_share >= 0.5 else AUTO_RECONSTRUCT_STEPS[1]


def _resolve_reconstruct_steps(opts: ConvertOptions, report: dict, kv_share: float) -> None:
    if opts.reconstruction.steps == "auto":
        opts.reconstruction.steps = report["options"]["reconstruct_steps"] = auto_reconstruct_steps(kv_share)
        logger.info("reconstruct_steps auto: %d (KV share %.3g)", opts.reconstruction.steps, kv_share)


def _is_main_process() -> bool:
    """Rank 0 of a distributed launch (torchrun and accelerate launch set RANK), or a plain single process."""
    return int(os.environ.get("RANK", "0")) == 0


def _calibrate(model, tokenizer, text: str, opts: ConvertOptions, report: dict) -> tuple[torch.Tensor, dict]:
    """(calibration windows, activation statistics of every attention layer) (recorded in the report)."""
    windows = calibration_windows(text, tokenizer, opts.calibration.samples, opts.calibration.length)
    if opts.calibration.source == "teacher":
        windows = teacher_windows(model, windows, seed=opts.seed)
    calib = opts.calibration
    report["calibration"] = {"data": calib.data or "package corpus (TinyStories sample)", "source": calib.source,
                             "split": calib.split, "column": calib.column, "samples": calib.samples,
                             "length": calib.length}  # fmt: skip
    return windows, collect_stats(model, windows)


def _layerwise(model, new, windows: torch.Tensor, relift, opts: ConvertOptions, report: dict) -> None:
    """Propagated calibration and / or reconstruction of every converted layer of `new`, in place (reconstruct.py)."""
    fits = sequential(model, new, windows, relift=relift, steps=opts.reconstruction.steps, lr=opts.reconstruction.lr,
                      target=opts.reconstruction.target)  # fmt: skip
    report["layerwise"] = {"propagate": relift is not None, "reconstruct_steps": opts.reconstruction.steps,
                           "target": opts.reconstruction.target, **summary(fits)}  # fmt: skip


def heal_layerwise(teacher, student, windows: torch.Tensor, steps: int) -> dict:
    """Healing's first stage (reconstruct target "block"): every attention layer of `student` fitted, layer by layer,
    so that its decoder layer's output matches the teacher's on the calibration windows; a summary for the report."""
    fits = sequential(teacher, student, windows, steps=steps, lr=LAYERWISE_LR, target="block")
    return {"steps": steps, "lr": LAYERWISE_LR, **summary(fits)}


def _heal(student, teacher, tokenizer, text: str, opts: ConvertOptions, samples: torch.Tensor | None = None) -> dict:
    """Distill the source into the converted model (heal.py); a summary for the report.

    Data (heal_data): calib: windows of the calibration text; teacher: the source's own continuations of
    TEACHER_PROMPT-token prompts cut from it (one window per training step and batch row, at most 64, reused
    cyclically; `samples`, the teacher calibration windows when calib_source is "teacher", are used instead of
    sampling again); mix: the two alternating. The last heal_held_in windows (of the same kind) are never trained on:
    they pick the learning rate (lr "auto") and the state returned."""
    from .heal import heal

    tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
    calib = calibration_windows(text, tokenizer, tokens // opts.calibration.length, opts.calibration.length)
    held = min(opts.healing.held_in, len(calib) // 2)
    if opts.healing.data == "calib":
        windows = calib
    elif samples is not None:  # teacher calibration windows: no second sampling
        plain = calib[: len(samples)]
        windows = samples if opts.healing.data == "teacher" else torch.stack((samples, plain), dim=1).flatten(0, 1)
        held = min(opts.healing.held_in, len(windows) // 2)
    else:  # enough for every process's batches (data parallel: each takes its own windows of a step)
        processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
        count = min(64, opts.healing.steps * opts.healing.batch_size * processes) + held
        prompts = calib[torch.randperm(len(calib), generator=torch.Generator().manual_seed(opts.seed))[:count]]
        sampled = teacher_windows(teacher, prompts, seed=opts.seed)
        if opts.healing.data == "teacher":
            windows = sampled
        else:  # alternate teacher and calibration windows; held in: the same mix
            plain = calib[: len(sampled)]
            windows = torch.stack((sampled, plain), dim=1).flatten(0, 1)
    train, held_in = windows[:-held], windows[-held:]
    h = opts.healing
    result = heal(student, teacher, train, steps=h.steps, lr=h.lr, held_in=held_in, batch_size=h.batch_size,
                  train=h.train, checkpoint_dir=h.checkpoint_dir, checkpoint_every=h.checkpoint_every,
                  resume=h.resume)  # fmt: skip
    return {"steps": result.steps, "tokens": result.tokens, "seconds": round(result.seconds, 2),
            "first_loss": result.losses[0], "last_loss": result.losses[-1], "train": opts.healing.train,
            "lr": result.lr, "lr_option": opts.healing.lr, "range_test": result.range_test, "data": opts.healing.data,
            "windows": len(train), "held_in_windows": held, "held_in_kl": result.held_in,
            "best_step": result.best_step, "losses": result.losses}  # fmt: skip


def _mla_sizes(opts: ConvertOptions, config, source_kv: int, d_h: int) -> tuple[int, int]:
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
        raise ValueError(f"kv_budget={opts.kv_budget} gives {budget} values per token: no room beside rope_dim={rope_dim}")
    return rope_dim, budget - rope_dim


def check_source_folder(source: str) -> None:
    """A local source folder must hold a config and safetensors weights; pickled .bin weights are refused unread."""
    folder = Path(source)
    if source in ("default", "smollm2") or not folder.is_dir():
        return
    if not (folder / "config.json").is_file():
        raise ValueError(f"{source!r} is not a model folder: it has no config.json")
    if not any(folder.glob("*.safetensors")) and any(folder.glob("*.bin")):
        raise ValueError(
            f"{source!r} holds only pickled .bin weights, which are refused: unpickling can run arbitrary code. "
            f"Fix: in an environment you trust, load it once and save it as safetensors: python -c \"from "
            f"transformers import AutoModelForCausalLM as M; M.from_pretrained('{source}').save_pretrained('{source}-st')\""
        )


def _source_folder(source: str) -> Path | None:
    """The local folder a source is read from, if any ('default' is the package's embedded model)."""
    folder = Path(DEFAULT_MODEL_DIR) if source == "default" else Path(source)
    return folder.resolve() if folder.exists() else None


STAGING = ".{name}.partial-{pid}-"  # staging folder of a conversion in progress: OUT's name and the writer's pid


def check_output(source: str, out: Path, overwrite: bool) -> None:
    """Refuse, before any work, an OUT that would overwrite or nest with the source, that is a file, that exists
    (without overwrite) or that cannot be written; remove staging folders left by conversions that were killed."""
    target, src = out.resolve(), _source_folder(source)
    if src is not None and (target == src or target in src.parents or src in target.parents):
        relation = "is" if target == src else "contains" if target in src.parents else "lies inside"
        raise ValueError(f"out={str(out)!r} {relation} the source {str(src)!r}: the source is never modified; "
                         f"choose an OUT outside it")  # fmt: skip
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is a file, not a folder: choose another OUT")
    if out.exists() and not overwrite:
        raise ValueError(f"out={str(out)!r} exists: pass overwrite=True (--overwrite) to replace it")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"out={str(out)!r} cannot be written: {str(parent)!r} is not a writable folder")
    if target.parent.exists():
        _remove_stale_staging(target)


def _remove_stale_staging(target: Path) -> None:
    prefix = f".{target.name}.partial-"
    for folder in target.parent.glob(prefix + "*"):
        pid = folder.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            logger.warning("removing %s, left by conversion process %s that no longer runs", folder, pid)
            shutil.rmtree(folder, ignore_errors=True)
        else:
            logger.warning("%s: the staging folder of another conversion to the same OUT (in progress?)", folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _write_atomically(model, tokenizer, report: dict, out: Path, max_shard_size: str) -> None:
    """Save into a temporary sibling folder, then rename it to `out`: never a half-written output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=STAGING.format(name=out.name, pid=os.getpid())))
    try:
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(staging)
        (staging / "conversion_report.json").write_text(json.dumps(report, indent=2, default=str))
        if "heal" in report and available("plot"):  # the held-in curve of healing (matplotlib: optional)
            h = report["heal"]
            plot_curve(h["losses"], h["held_in_kl"], h["best_step"], h["lr"], staging / "heal_curve.png")
        (staging / "README.md").write_text(model_card(report))
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp made it 0700: the finished folder gets ordinary permissions
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
