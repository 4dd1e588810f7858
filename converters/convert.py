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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers.utils.hub import convert_file_size_to_int

from ..devices import resolve_device
from ..extras import available, require
from ..kv_memory import dtype_of, kv_cache_bytes
from ..models.architectures import architecture_of, head_dim, rotary_dim
from ..models.pretrained import DEFAULT_MODEL_DIR
from .calibration import (CALIB_SOURCES, TEACHER_PROMPT, calibration_windows, collect_stats, is_dataset_source,
                          read_calibration_text, teacher_windows)
from .deepseek_export import ENGINES, check_source, engine_shape, stock_frequencies, to_deepseek_v3
from .budgets import allocate, candidate_grid
from .exact import rebuild, stock_attention_layers
from .hub import check_repo_id, engines, model_card, push
from .gqa_merge import GQA_METHODS, gqa_layer
from .heal import plot_curve
from .heal_fsdp import launch_mode
from .reconstruct import TARGETS as RECONSTRUCT_TARGETS
from .reconstruct import LAYERWISE_LR, sequential, summary
from .methods import MLA_METHODS, allocate_ranks, lift_plan, plan_layer, ranked_components

logger = logging.getLogger(__name__)

TARGETS = ("gqa", "mqa", "mla")
FORMATS = ("auto", "native", "stock", "deepseek_v3")
HEAL_DATA = ("calib", "teacher", "mix")
STOCK_GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # configs with a native num_key_value_heads
RANK_ALLOCATIONS = ("uniform", "energy", "sensitivity")
# reconstruct_steps "auto" (the CLI's default): steps per layer when the conversion keeps >= half the source's KV
# values, and below: there the closed form starts further off and 60 steps end with most layers still improving
# (SmolLM2 MQA 3->1 / MLA 25%, held-in teacher KL, docs/research-log.md)
AUTO_RECONSTRUCT_STEPS = (60, 150)


@dataclass
class ConvertOptions:
    """What to convert to, and how. Validated on construction (errors name the option and its value)."""

    to: str
    kv_heads: int | None = None  # gqa: KV heads after conversion (mqa: 1)
    kv_lora_rank: int | None = None  # mla: latent dims d_c
    rope_dim: int | None = None  # mla: shared RoPE key dims d_r (default: one head's d_h, at most 1/3 of kv_budget)
    kv_budget: float | None = None  # mla: fraction of the source's KV values per token (instead of kv_lora_rank)
    method: str | None = None  # gqa: pca (default), aligned or mean; mla: calibrated (default) or mha2mla
    regroup: bool | None = None  # gqa aligned / pca: group KV heads by similarity, not by index (default True)
    rank_allocation: str | None = None  # mla with kv_budget: sensitivity (budgets.py; default with a native format),
    # uniform (the default otherwise) or energy (measured worse)
    calib_data: str | None = None  # text file, folder of .txt files or a datasets dataset; default: the package's corpus
    calib_split: str = "train"  # datasets only
    calib_column: str = "text"  # datasets only
    calib_samples: int = 32  # SmolLM2 MLA 50%: 32 vs 16 lowers the held-in teacher KL after reconstruction (BENCHMARKS)
    calib_len: int = 256
    calib_source: str = "teacher"  # teacher: the source's own samples, prompted from calib_data; text: its windows
    propagate: bool = False  # each layer's closed form recomputed from the converted prefix's statistics (kept if better)
    reconstruct_steps: int | str = "auto"  # Adam steps fitting each converted layer's output; "auto": by the KV share
    # kept (auto_reconstruct_steps); 0: the closed form only
    reconstruct_lr: float = 1e-2  # reconstruction step, as a fraction of each weight tensor's RMS (SmolLM2: best held-in)
    reconstruct_target: str = "source"  # source: the source layer on its own inputs; local: on the converted ones
    heal_steps: int = 0  # distillation steps from the source after conversion (0: zero-shot)
    heal_lr: float | str | None = None  # a rate, or "auto" (default): a range test on held-in windows
    heal_data: str | None = None  # teacher: the source's own samples (default); calib: the calibration text; mix: both
    heal_held_in: int | None = None  # windows held out of healing to keep its best state (default 4)
    heal_batch_size: int | None = None  # windows of calib_len tokens per step, cut from the calibration text (default 4)
    heal_train: str | None = None  # attention (default): only the converted layers; all: every weight
    heal_layerwise_steps: int | None = None  # healing's first stage: Adam steps per decoder layer fitting its output
    # to the source's on the calibration windows (reconstruct target "block"); default 40, 0: none (BENCHMARKS)
    checkpoint_dir: str | None = None  # healing state saved here every checkpoint_every steps
    checkpoint_every: int = 0
    resume: bool = False  # continue healing from the last state in checkpoint_dir
    format: str = "auto"  # native: our config fields; stock: plain config (llama-family GQA); deepseek_v3 (MLA)
    engine: str | None = None  # deepseek_v3: the engine whose MLA shapes the export takes (default llama.cpp)
    dtype: str | None = None  # of the saved weights; default: the source's
    device: str = "auto"  # where the model passes run (sampling, statistics, sensitivity, fits); auto: cuda if any
    seed: int = 0
    overwrite: bool = False
    max_shard_size: str = "2GB"  # weights above this are split into shards with model.safetensors.index.json
    push_to_hub: str | None = None  # owner/name: upload the finished folder (huggingface_hub)
    private: bool = False

    def __post_init__(self) -> None:
        if self.to not in TARGETS:
            raise ValueError(f"to={self.to!r} is not one of {TARGETS}")
        self._refuse_inapplicable()
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} is not one of {FORMATS}")
        methods = MLA_METHODS if self.to == "mla" else GQA_METHODS
        self.method = self.method or methods[0]
        if self.method not in methods:
            raise ValueError(f"method={self.method!r} is not one of {methods} for to={self.to!r}")
        if self.to == "mqa":
            if self.kv_heads not in (None, 1):
                raise ValueError(f"kv_heads={self.kv_heads!r}: MQA has exactly one KV head")
            self.kv_heads = 1
        if self.to == "gqa" and self.kv_heads is None:
            raise ValueError("to='gqa' needs kv_heads")
        if self.rank_allocation is None:  # measured best (BENCHMARKS.md); stock DeepSeek has one rank for all layers
            sensitivity = self.to == "mla" and self.kv_budget is not None and self.format != "deepseek_v3"
            self.rank_allocation = "sensitivity" if sensitivity else "uniform"
        if self.rank_allocation not in RANK_ALLOCATIONS:
            raise ValueError(f"rank_allocation={self.rank_allocation!r} is not one of {RANK_ALLOCATIONS}")
        if self.rank_allocation == "sensitivity" and (self.to != "mla" or self.kv_budget is None
                                                      or self.format == "deepseek_v3"):  # fmt: skip
            raise ValueError("rank_allocation='sensitivity' needs to='mla', kv_budget and a native format (stock "
                             "DeepSeek has one kv_lora_rank and one qk_rope_head_dim for all layers)")  # fmt: skip
        if self.rank_allocation == "energy" and (self.to != "mla" or self.kv_budget is None or self.method != "calibrated"
                                                 or self.format == "deepseek_v3"):
            raise ValueError("rank_allocation='energy' needs to='mla', kv_budget, method='calibrated' and a native "
                             "format (stock DeepSeek has one kv_lora_rank)")
        if self.format == "stock" and self.to == "mla":
            raise ValueError("format='stock' exists for GQA/MQA only; an MLA export is 'native' or 'deepseek_v3'")
        if self.format == "deepseek_v3" and self.to != "mla":
            raise ValueError(f"format='deepseek_v3' is an MLA export, not one for to={self.to!r}")
        if self.engine is not None and self.format != "deepseek_v3":
            raise ValueError(f"engine={self.engine!r} applies to format='deepseek_v3' only, not format={self.format!r}")
        if self.format == "deepseek_v3":
            self.engine = self.engine or "llama.cpp"
            if self.engine not in ENGINES:
                raise ValueError(f"engine={self.engine!r} is not one of {ENGINES}")
        if self.to == "mla":
            if (self.kv_lora_rank is None) == (self.kv_budget is None):
                raise ValueError(
                    f"to='mla' needs exactly one of kv_lora_rank={self.kv_lora_rank!r} and kv_budget={self.kv_budget!r}"
                )
            if self.kv_budget is not None and not 0 < self.kv_budget <= 1:
                raise ValueError(f"kv_budget={self.kv_budget!r} must be a fraction in (0, 1]")
        if not isinstance(self.heal_steps, int) or self.heal_steps < 0:
            raise ValueError(f"heal_steps={self.heal_steps!r} must be a non-negative integer")
        if self.heal_train not in ("attention", "all"):
            raise ValueError(f"heal_train={self.heal_train!r} is not one of ('attention', 'all')")
        if self.heal_lr != "auto" and (isinstance(self.heal_lr, (str, bool)) or not self.heal_lr > 0):
            raise ValueError(f"heal_lr={self.heal_lr!r} must be a positive number or 'auto'")
        if self.calib_source not in CALIB_SOURCES:
            raise ValueError(f"calib_source={self.calib_source!r} is not one of {CALIB_SOURCES}")
        if self.heal_data not in HEAL_DATA:
            raise ValueError(f"heal_data={self.heal_data!r} is not one of {HEAL_DATA}")
        if self.push_to_hub is not None:
            check_repo_id(self.push_to_hub)
        try:  # checked now: save_pretrained would only find out after converting and healing
            shard_bytes = convert_file_size_to_int(self.max_shard_size)
        except (ValueError, TypeError):
            shard_bytes = 0
        if shard_bytes <= 0:
            raise ValueError(f"max_shard_size={self.max_shard_size!r}: expected a positive size such as '2GB' or '500MB'")
        if (self.resume or self.checkpoint_every) and self.checkpoint_dir is None:
            raise ValueError("resume / checkpoint_every need checkpoint_dir")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every={self.checkpoint_every!r} must be a non-negative integer")
        for name in ("kv_heads", "kv_lora_rank", "calib_samples", "calib_len", "heal_batch_size", "heal_held_in"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.rope_dim is not None and (not isinstance(self.rope_dim, int) or self.rope_dim < 0 or self.rope_dim % 2):
            raise ValueError(f"rope_dim={self.rope_dim!r} must be an even non-negative integer")
        if self.calib_data is not None and is_dataset_source(self.calib_data):
            require("convert", f"calib_data={self.calib_data!r} (a datasets dataset)")
        if self.heal_steps:
            launch_mode()  # a distributed launch healing cannot use (DeepSpeed, FSDP1) is refused before any work
        if self.heal_steps and not available("plot"):
            logger.warning("matplotlib is not installed: the healed model is written without heal_curve.png "
                           "(pip install 'hf-attn-patch[plot]')")  # fmt: skip
        if self.dtype is not None:
            dtype_of(self.dtype)  # raises naming the value
        resolve_device(self.device)  # raises naming the value
        for name in ("reconstruct_steps", "heal_layerwise_steps"):
            value = getattr(self, name)
            if name == "reconstruct_steps" and value == "auto":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer")
        if not isinstance(self.reconstruct_lr, (int, float)) or not self.reconstruct_lr > 0:
            raise ValueError(f"reconstruct_lr={self.reconstruct_lr!r} must be a positive number")
        if self.reconstruct_target not in RECONSTRUCT_TARGETS:
            raise ValueError(f"reconstruct_target={self.reconstruct_target!r} is not one of {RECONSTRUCT_TARGETS}")
        if (self.propagate or self.reconstruct_steps or self.heal_steps and self.heal_layerwise_steps) \
                and self.calib_samples < 2:  # fmt: skip
            raise ValueError(f"calib_samples={self.calib_samples!r}: propagate / reconstruct_steps / "
                             "heal_layerwise_steps hold one window in, so they need at least 2")  # fmt: skip

    def _refuse_inapplicable(self) -> None:
        """An option the chosen target or method would ignore is an error (it was given for a reason), then the
        defaults of the options that apply are filled in."""
        inapplicable = {"mla": ("kv_lora_rank", "rope_dim", "kv_budget"), "gqa": ("kv_heads",),
                        "regroup": ("regroup",),
                        "heal": ("heal_lr", "heal_batch_size", "heal_train", "checkpoint_dir", "resume", "heal_data",
                                 "heal_held_in", "heal_layerwise_steps")}  # fmt: skip
        given = lambda group: [n for n in inapplicable[group] if getattr(self, n) not in (None, False)]  # noqa: E731
        if self.to != "mla" and given("mla"):
            raise ValueError(f"{given('mla')[0]}={getattr(self, given('mla')[0])!r} applies to to='mla' only, "
                             f"not to={self.to!r}")  # fmt: skip
        if self.to == "mla" and given("gqa"):
            raise ValueError(f"kv_heads={self.kv_heads!r} applies to to='gqa' / 'mqa' only, not to='mla'")
        method = self.method or (MLA_METHODS if self.to == "mla" else GQA_METHODS)[0]
        if self.regroup is not None and (self.to == "mla" or method == "mean"):
            raise ValueError(f"regroup={self.regroup!r} applies to to='gqa' / 'mqa' with method 'aligned' or 'pca', "
                             f"not to={self.to!r} with method={method!r}")  # fmt: skip
        if not self.heal_steps and given("heal"):
            raise ValueError(f"{given('heal')[0]}={getattr(self, given('heal')[0])!r} applies to healing only: "
                             f"set heal_steps (--heal-steps N)")  # fmt: skip
        defaults = {"regroup": True, "heal_lr": "auto", "heal_batch_size": 4, "heal_train": "attention",
                    "heal_data": "teacher", "heal_held_in": 4, "heal_layerwise_steps": 40}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)


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
    opts = ConvertOptions(**options)
    out = Path(out)
    check_output(source, out, opts.overwrite)  # the source folder is checked by load_source, before any weight
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
    report = {"source": str(source), "options": asdict(opts), "given_options": dict(options),
              "model_type": config.model_type}
    text = functools.cache(lambda: read_calibration_text(opts.calib_data, opts.calib_split, opts.calib_column))
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
        layerwise = opts.reconstruct_steps or (opts.propagate and opts.method != "mean")
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
        if sensitivity:  # the candidate grid is checked against the budget before calibrating
            candidate_grid(config, opts.kv_budget, opts.rope_dim)
        windows, stats = _calibrate(model, tokenizer, text(), opts, report)
        weights = {name: arch.split_heads(module).cpu() for name, module in layers.items()}
        frequencies = stride = None
        rope_dims = [rope_dim] * len(weights)
        if sensitivity:  # per-layer RoPE dims and ranks (or the exact layer) by measured KL
            plans, ranks, rope_dims, report["budgets"] = allocate(
                model, layers, weights, stats, windows, config, opts.kv_budget, opts.method, opts.calib_len,
                opts.rope_dim)  # fmt: skip
        else:
            ranked = {name: ranked_components(opts.method, w, config, stats[name], opts.calib_len) if rope_dim
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
        if opts.propagate or opts.reconstruct_steps:
            index = {name: i for i, name in enumerate(layers)}

            def relift(name, layer_stats):  # same ranks and RoPE frequencies, from the converted prefix's statistics
                freqs, layer_rope = per_layer_pairs[index[name]] or [], rope_dims[index[name]]
                exact = sensitivity and report["budgets"]["layers"][index[name]]["choice"] != "mla"
                plan = plans[name] if exact else plan_layer(opts.method, weights[name], config, layer_stats, layer_rope,
                                                            opts.calib_len, frequencies=freqs if layer_rope else None)  # fmt: skip
                return lift_plan(plan, weights[name], config, ranks[index[name]])[0]

            _layerwise(model, new, windows, relift if opts.propagate else None, opts, report)

    if opts.heal_steps and opts.heal_layerwise_steps:  # healing's first stage, layer by layer, on the native form
        if windows is None:
            windows = calibration_windows(text(), tokenizer, opts.calib_samples, opts.calib_len)
        report["heal_layerwise"] = heal_layerwise(model, new, windows, opts.heal_layerwise_steps)
    if opts.heal_steps:
        report["heal"] = _heal(new, model, tokenizer, text(), opts,
                               windows if opts.calib_source == "teacher" else None)  # fmt: skip
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
    _write_atomically(new, tokenizer, report, out, opts.max_shard_size)
    logger.info("converted %s -> %s (%s, %s)", source, out, opts.to, opts.method)
    if opts.push_to_hub is not None:
        report["hub"] = push(out, opts.push_to_hub, private=opts.private, client=hub_client)
    return report


def auto_reconstruct_steps(kv_share: float) -> int:
    """reconstruct_steps="auto": AUTO_RECONSTRUCT_STEPS[0] when the conversion keeps at least half the source's KV
    values per token (kv_share >= 0.5), AUTO_RECONSTRUCT_STEPS[1] below."""
    return AUTO_RECONSTRUCT_STEPS[0] if kv_share >= 0.5 else AUTO_RECONSTRUCT_STEPS[1]


def _resolve_reconstruct_steps(opts: ConvertOptions, report: dict, kv_share: float) -> None:
    if opts.reconstruct_steps == "auto":
        opts.reconstruct_steps = report["options"]["reconstruct_steps"] = auto_reconstruct_steps(kv_share)
        logger.info("reconstruct_steps auto: %d (KV share %.3g)", opts.reconstruct_steps, kv_share)


def _is_main_process() -> bool:
    """Rank 0 of a distributed launch (torchrun and accelerate launch set RANK), or a plain single process."""
    return int(os.environ.get("RANK", "0")) == 0


def _calibrate(model, tokenizer, text: str, opts: ConvertOptions, report: dict) -> tuple[torch.Tensor, dict]:
    """(calibration windows, activation statistics of every attention layer) (recorded in the report)."""
    windows = calibration_windows(text, tokenizer, opts.calib_samples, opts.calib_len)
    if opts.calib_source == "teacher":
        windows = teacher_windows(model, windows, seed=opts.seed)
    report["calibration"] = {"data": opts.calib_data or "package corpus (TinyStories sample)",
                             "source": opts.calib_source, "split": opts.calib_split, "column": opts.calib_column,
                             "samples": opts.calib_samples, "length": opts.calib_len}  # fmt: skip
    return windows, collect_stats(model, windows)


def _layerwise(model, new, windows: torch.Tensor, relift, opts: ConvertOptions, report: dict) -> None:
    """Propagated calibration and / or reconstruction of every converted layer of `new`, in place (reconstruct.py)."""
    fits = sequential(model, new, windows, relift=relift, steps=opts.reconstruct_steps, lr=opts.reconstruct_lr,
                      target=opts.reconstruct_target)  # fmt: skip
    report["layerwise"] = {"propagate": relift is not None, "reconstruct_steps": opts.reconstruct_steps,
                           "target": opts.reconstruct_target, **summary(fits)}  # fmt: skip


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
    calib = calibration_windows(text, tokenizer, tokens // opts.calib_len, opts.calib_len)
    held = min(opts.heal_held_in, len(calib) // 2)
    if opts.heal_data == "calib":
        windows = calib
    elif samples is not None:  # teacher calibration windows: no second sampling
        plain = calib[: len(samples)]
        windows = samples if opts.heal_data == "teacher" else torch.stack((samples, plain), dim=1).flatten(0, 1)
        held = min(opts.heal_held_in, len(windows) // 2)
    else:  # enough for every process's batches (data parallel: each takes its own windows of a step)
        processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun / accelerate launch
        count = min(64, opts.heal_steps * opts.heal_batch_size * processes) + held
        prompts = calib[torch.randperm(len(calib), generator=torch.Generator().manual_seed(opts.seed))[:count]]
        sampled = teacher_windows(teacher, prompts, seed=opts.seed)
        if opts.heal_data == "teacher":
            windows = sampled
        else:  # alternate teacher and calibration windows; held in: the same mix
            plain = calib[: len(sampled)]
            windows = torch.stack((sampled, plain), dim=1).flatten(0, 1)
    train, held_in = windows[:-held], windows[-held:]
    result = heal(student, teacher, train, steps=opts.heal_steps, lr=opts.heal_lr, held_in=held_in,
                  batch_size=opts.heal_batch_size, train=opts.heal_train, checkpoint_dir=opts.checkpoint_dir,
                  checkpoint_every=opts.checkpoint_every, resume=opts.resume)  # fmt: skip
    return {"steps": result.steps, "tokens": result.tokens, "seconds": round(result.seconds, 2),
            "first_loss": result.losses[0], "last_loss": result.losses[-1], "train": opts.heal_train,
            "lr": result.lr, "lr_option": opts.heal_lr, "range_test": result.range_test, "data": opts.heal_data,
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
