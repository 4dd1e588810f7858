"""The options of `convert()`: nested dataclasses, each validated on construction.

    ConvertOptions(to, kv_heads, kv_lora_rank, rope_dim, kv_budget, method, regroup, rank_allocation, rope_context,
                   format, engine, seed, device, dtype,
                   calibration: CalibrationOptions(data, split, column, samples, length, source, propagate),
                   reconstruction: ReconstructionOptions(steps, lr, target, attention_kl),
                   healing: HealingOptions(steps, lr, data, held_in, batch_size, length, train, layerwise_steps,
                                           checkpoint_dir, checkpoint_every, resume),
                   output: OutputOptions(overwrite, max_shard_size, push_to_hub, private))

Users give flat names (`convert(..., calib_samples=16)`, `--calib-samples 16`); `ConvertOptions.from_flat` maps them
onto the sections (FLAT_NAMES) and `flat()` maps back. Errors name the flat name and the value ("calib_samples=1 ..."),
since that is what the user typed. An option that does not apply to the chosen target, method or healing is refused;
the defaults of the options that apply are filled in (those that do not apply stay None).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers.utils.hub import convert_file_size_to_int

from ..devices import resolve_device
from ..extras import available, require
from ..kv_memory import dtype_of
from .io.calibration import CALIB_SOURCES, is_dataset_source
from .export.constants import ENGINES
from .methods.gqa_merge import GQA_METHODS
from .fitting.heal_fsdp import launch_mode
from ..hub import check_repo_id
from .methods.mla_plan import MLA_METHODS
from .fitting.reconstruct import TARGETS as RECONSTRUCT_TARGETS

logger = logging.getLogger(__name__)

TARGETS = ("gqa", "mqa", "mla")
FORMATS = ("auto", "native", "stock", "deepseek_v3")
HEAL_DATA = ("calib", "teacher", "mix")
RANK_ALLOCATIONS = ("uniform", "energy", "sensitivity")


def _positive_int(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _non_negative_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


@dataclass
class CalibrationOptions:
    """The activations the closed forms are fitted to: `samples` windows of `length` tokens (flat names calib_*)."""

    data: str | None = None  # text file, folder of .txt files or a datasets dataset; default: the package's corpus
    split: str = "train"  # datasets only
    column: str = "text"  # datasets only
    samples: int = 32  # SmolLM2 MLA 50%: 32 vs 16 lowers the held-in teacher KL after reconstruction (BENCHMARKS)
    length: int = 256
    source: str = "teacher"  # teacher: the source's own samples, prompted from data; text: its windows
    propagate: bool = False  # each layer's closed form recomputed from the converted prefix's statistics (kept if better)

    def __post_init__(self) -> None:
        _one_of("calib_source", self.source, CALIB_SOURCES)
        _positive_int("calib_samples", self.samples)
        _positive_int("calib_len", self.length)
        if self.data is not None and is_dataset_source(self.data):
            require("convert", f"calib_data={self.data!r} (a datasets dataset)")


@dataclass
class ReconstructionOptions:
    """Adam steps fitting each converted layer's output after its closed form (flat names reconstruct_*)."""

    steps: int | str = "auto"  # "auto": by the KV share kept (convert.auto_reconstruct_steps); 0: the closed form only
    lr: float = 1e-2  # step as a fraction of each weight tensor's RMS (SmolLM2: best held-in)
    target: str = "source"  # source: the source layer on its own inputs; local: on the converted ones
    attention_kl: float = 0.0  # weight of the attention-pattern KL to the source's beside the output error

    def __post_init__(self) -> None:
        if self.steps != "auto":
            _non_negative_int("reconstruct_steps", self.steps)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"reconstruct_lr={self.lr!r} must be a positive number")
        _one_of("reconstruct_target", self.target, RECONSTRUCT_TARGETS)
        if isinstance(self.attention_kl, bool) or not isinstance(self.attention_kl, (int, float)) or self.attention_kl < 0:
            raise ValueError(f"reconstruct_attention_kl={self.attention_kl!r} must be a non-negative number")


# HealingOptions field -> its default, filled in when healing runs (steps > 0); given without healing: refused
# (length: calib_len, filled in by ConvertOptions)
HEAL_DEFAULTS = {"lr": "auto", "data": "teacher", "held_in": 4, "batch_size": 4, "length": None, "train": "attention",
                 "layerwise_steps": 40, "checkpoint_dir": None, "resume": False}  # fmt: skip


@dataclass
class HealingOptions:
    """Distillation from the source after conversion (flat names heal_*, checkpoint_dir / checkpoint_every, resume)."""

    steps: int = 0  # 0: zero-shot (no healing; the other fields must stay unset)
    lr: float | str | None = None  # a rate, or "auto" (default): a range test on held-in windows
    data: str | None = None  # teacher: the source's own samples (default); calib: the calibration text; mix: both
    held_in: int | None = None  # windows held out of healing to keep its best state (default 4)
    batch_size: int | None = None  # windows per step (default 4)
    length: int | None = None  # tokens per healing window (default calib_len); long windows train long-range
    # attention (teacher samples of this length are drawn for it: the calibration samples are calib_len long)
    train: str | None = None  # attention (default): only the converted layers; all: every weight
    layerwise_steps: int | None = None  # first stage: Adam steps per decoder layer fitting its output to the
    # source's on the calibration windows (reconstruct target "block"); default 40, 0: none (BENCHMARKS)
    checkpoint_dir: str | None = None  # healing state saved here every checkpoint_every steps
    checkpoint_every: int = 0
    resume: bool = False  # continue healing from the last state in checkpoint_dir

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ValueError(f"heal_steps={self.steps!r} must be a non-negative integer")
        if not self.steps:
            given = [n for n in HEAL_DEFAULTS if getattr(self, n) not in (None, False)]
            if given:  # it was given for a reason: healing would have used it
                raise ValueError(f"{flat_name('healing', given[0])}={getattr(self, given[0])!r} applies to healing "
                                 f"only: set heal_steps (--heal-steps N)")  # fmt: skip
        else:
            for name, value in HEAL_DEFAULTS.items():
                if getattr(self, name) is None:
                    setattr(self, name, value)
            _one_of("heal_train", self.train, ("attention", "all"))
            if self.lr != "auto" and (isinstance(self.lr, (str, bool)) or not self.lr > 0):
                raise ValueError(f"heal_lr={self.lr!r} must be a positive number or 'auto'")
            _one_of("heal_data", self.data, HEAL_DATA)
            _positive_int("heal_batch_size", self.batch_size)
            _positive_int("heal_len", self.length)
            _positive_int("heal_held_in", self.held_in)
            _non_negative_int("heal_layerwise_steps", self.layerwise_steps)
        if (self.resume or self.checkpoint_every) and self.checkpoint_dir is None:
            raise ValueError("resume / checkpoint_every need checkpoint_dir")
        _non_negative_int("checkpoint_every", self.checkpoint_every)
        if self.steps:
            launch_mode()  # a distributed launch healing cannot use (DeepSpeed, FSDP1) is refused before any work
            if not available("plot"):
                logger.warning("matplotlib is not installed: the healed model is written without heal_curve.png "
                               "(pip install 'hf-attn-patch[plot]')")  # fmt: skip


@dataclass
class OutputOptions:
    """How the finished folder is written and published."""

    overwrite: bool = False
    max_shard_size: str = "2GB"  # weights above this are split into shards with model.safetensors.index.json
    push_to_hub: str | None = None  # owner/name: upload the finished folder (huggingface_hub)
    private: bool = False

    def __post_init__(self) -> None:
        try:  # checked now: save_pretrained would only find out after converting and healing
            shard_bytes = convert_file_size_to_int(self.max_shard_size)
        except (ValueError, TypeError):
            shard_bytes = 0
        if shard_bytes <= 0:
            raise ValueError(f"max_shard_size={self.max_shard_size!r}: expected a positive size such as '2GB' or '500MB'")
        if self.push_to_hub is not None:
            try:
                check_repo_id(self.push_to_hub)
            except ValueError:
                raise ValueError(f"push_to_hub={self.push_to_hub!r} must look like 'owner/name'") from None


SECTIONS = {"calibration": CalibrationOptions, "reconstruction": ReconstructionOptions, "healing": HealingOptions,
            "output": OutputOptions}  # fmt: skip
# Every flat option name (convert()'s keywords, the CLI's --flags, the report's "options"), in the report's order,
# -> (section, field), or None for a field of ConvertOptions itself.
FLAT_NAMES = {
    "to": None, "kv_heads": None, "kv_lora_rank": None, "rope_dim": None, "kv_budget": None, "method": None,
    "regroup": None, "rank_allocation": None, "rope_context": None,
    "calib_data": ("calibration", "data"), "calib_split": ("calibration", "split"),
    "calib_column": ("calibration", "column"), "calib_samples": ("calibration", "samples"),
    "calib_len": ("calibration", "length"), "calib_source": ("calibration", "source"),
    "propagate": ("calibration", "propagate"),
    "reconstruct_steps": ("reconstruction", "steps"), "reconstruct_lr": ("reconstruction", "lr"),
    "reconstruct_target": ("reconstruction", "target"), "reconstruct_attention_kl": ("reconstruction", "attention_kl"),
    "heal_steps": ("healing", "steps"), "heal_lr": ("healing", "lr"), "heal_data": ("healing", "data"),
    "heal_held_in": ("healing", "held_in"), "heal_batch_size": ("healing", "batch_size"),
    "heal_len": ("healing", "length"), "heal_train": ("healing", "train"), "heal_layerwise_steps": ("healing", "layerwise_steps"),
    "checkpoint_dir": ("healing", "checkpoint_dir"), "checkpoint_every": ("healing", "checkpoint_every"),
    "resume": ("healing", "resume"),
    "format": None, "engine": None, "dtype": None, "device": None, "seed": None,
    "overwrite": ("output", "overwrite"), "max_shard_size": ("output", "max_shard_size"),
    "push_to_hub": ("output", "push_to_hub"), "private": ("output", "private"),
}  # fmt: skip


def flat_name(section: str, name: str) -> str:
    """The flat (user-facing) name of a section's field: ("calibration", "samples") -> "calib_samples"."""
    return next(flat for flat, place in FLAT_NAMES.items() if place == (section, name))


@dataclass
class ConvertOptions:
    """What to convert to, and how. Each section validates itself on construction, then the checks that span
    sections run here (errors name the option and its value)."""

    to: str
    kv_heads: int | None = None  # gqa: KV heads after conversion (mqa: 1)
    kv_lora_rank: int | None = None  # mla: latent dims d_c
    rope_dim: int | None = None  # mla: shared RoPE key dims d_r (default: one head's d_h, at most 1/3 of kv_budget)
    kv_budget: float | None = None  # mla: fraction of the source's KV values per token (instead of kv_lora_rank)
    method: str | None = None  # gqa: pca (default), aligned or mean; mla: calibrated (default) or mha2mla
    regroup: bool | None = None  # gqa aligned / pca: group KV heads by similarity, not by index (default True)
    rank_allocation: str | None = None  # mla with kv_budget: sensitivity (budgets.py; default with a native format),
    # uniform (the default otherwise) or energy (measured worse)
    rope_context: int | None = None  # mla: L, the distances (tokens) the RoPE split keeps rotation for: a dropped
    # component costs energy x 2(1 - sinc(theta L)) (methods.py); default: calib_len
    format: str = "auto"  # native: our config fields; stock: plain config (llama-family GQA); deepseek_v3 (MLA)
    engine: str | None = None  # deepseek_v3: the engine whose MLA shapes the export takes (default llama.cpp)
    seed: int = 0
    device: str = "auto"  # where the model passes run (sampling, statistics, sensitivity, fits); auto: cuda if any
    dtype: str | None = None  # of the saved weights; default: the source's
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)
    reconstruction: ReconstructionOptions = field(default_factory=ReconstructionOptions)
    healing: HealingOptions = field(default_factory=HealingOptions)
    output: OutputOptions = field(default_factory=OutputOptions)

    @classmethod
    def from_flat(cls, **options) -> ConvertOptions:
        """From convert()'s flat keywords (FLAT_NAMES); an unknown name is a TypeError naming it."""
        unknown = [name for name in options if name not in FLAT_NAMES]
        if unknown:
            raise TypeError(f"unknown conversion option {unknown[0]!r}; the options are {', '.join(FLAT_NAMES)}")
        top = {name: v for name, v in options.items() if FLAT_NAMES[name] is None}
        sections = {section: {} for section in SECTIONS}
        for name, value in options.items():
            if FLAT_NAMES[name] is not None:
                section, key = FLAT_NAMES[name]
                sections[section][key] = value
        if "to" not in top:
            raise TypeError("the conversion option 'to' is required (one of 'gqa', 'mqa', 'mla')")
        return cls(**top, **{section: SECTIONS[section](**kw) for section, kw in sections.items()})

    def flat(self) -> dict:
        """The flat options, by FLAT_NAMES (the report's "options"); ConvertOptions.from_flat(**o.flat()) == o."""
        return {name: getattr(self if place is None else getattr(self, place[0]), name if place is None else place[1])
                for name, place in FLAT_NAMES.items()}  # fmt: skip

    def __post_init__(self) -> None:
        for section, kind in SECTIONS.items():
            if not isinstance(getattr(self, section), kind):
                raise TypeError(f"{section}={getattr(self, section)!r} is not a {kind.__name__}")
        _one_of("to", self.to, TARGETS)
        self._refuse_inapplicable()
        _one_of("format", self.format, FORMATS)
        methods = MLA_METHODS if self.to == "mla" else GQA_METHODS
        self.method = self.method or methods[0]
        if self.method not in methods:
            raise ValueError(f"method={self.method!r} is not one of {methods} for to={self.to!r}")
        if self.to != "mla" and self.method != "mean" and self.regroup is None:
            self.regroup = True
        if self.to == "mqa":
            if self.kv_heads not in (None, 1):
                raise ValueError(f"kv_heads={self.kv_heads!r}: MQA has exactly one KV head")
            self.kv_heads = 1
        if self.to == "gqa" and self.kv_heads is None:
            raise ValueError("to='gqa' needs kv_heads")
        self._check_rank_allocation()
        if self.format == "stock" and self.to == "mla":
            raise ValueError("format='stock' exists for GQA/MQA only; an MLA export is 'native' or 'deepseek_v3'")
        if self.format == "deepseek_v3" and self.to != "mla":
            raise ValueError(f"format='deepseek_v3' is an MLA export, not one for to={self.to!r}")
        if self.engine is not None and self.format != "deepseek_v3":
            raise ValueError(f"engine={self.engine!r} applies to format='deepseek_v3' only, not format={self.format!r}")
        if self.format == "deepseek_v3":
            self.engine = self.engine or "llama.cpp"
            _one_of("engine", self.engine, ENGINES)
        if self.to == "mla":
            if (self.kv_lora_rank is None) == (self.kv_budget is None):
                raise ValueError(
                    f"to='mla' needs exactly one of kv_lora_rank={self.kv_lora_rank!r} and kv_budget={self.kv_budget!r}"
                )
            if self.kv_budget is not None and not 0 < self.kv_budget <= 1:
                raise ValueError(f"kv_budget={self.kv_budget!r} must be a fraction in (0, 1]")
        _positive_int("kv_heads", self.kv_heads)
        _positive_int("kv_lora_rank", self.kv_lora_rank)
        if self.to == "mla" and self.rope_context is None:  # the calibration window (the source's context costs
            self.rope_context = self.calibration.length  # short-range quality: docs/conversion-methods.md)
        _positive_int("rope_context", self.rope_context)
        if self.rope_dim is not None and (not isinstance(self.rope_dim, int) or self.rope_dim < 0 or self.rope_dim % 2):
            raise ValueError(f"rope_dim={self.rope_dim!r} must be an even non-negative integer")
        if self.dtype is not None:
            dtype_of(self.dtype)  # raises naming the value
        resolve_device(self.device)  # raises naming the value
        heal = self.healing
        if heal.steps and heal.length is None:
            heal.length = self.calibration.length
        if (self.calibration.propagate or self.reconstruction.steps or heal.steps and heal.layerwise_steps) \
                and self.calibration.samples < 2:  # fmt: skip
            raise ValueError(f"calib_samples={self.calibration.samples!r}: propagate / reconstruct_steps / "
                             "heal_layerwise_steps hold one window in, so they need at least 2")  # fmt: skip

    def _refuse_inapplicable(self) -> None:
        """An option the chosen target or method would ignore is an error (it was given for a reason)."""
        mla_only = [n for n in ("kv_lora_rank", "rope_dim", "kv_budget", "rope_context")
                    if getattr(self, n) is not None]
        if self.to != "mla" and mla_only:
            raise ValueError(f"{mla_only[0]}={getattr(self, mla_only[0])!r} applies to to='mla' only, not to={self.to!r}")
        if self.to == "mla" and self.kv_heads is not None:
            raise ValueError(f"kv_heads={self.kv_heads!r} applies to to='gqa' / 'mqa' only, not to='mla'")
        rec = self.reconstruction
        if rec.attention_kl and rec.steps == 0 and not self.calibration.propagate:
            raise ValueError(f"reconstruct_attention_kl={rec.attention_kl!r} needs reconstruct_steps > 0 or propagate")
        method = self.method or (MLA_METHODS if self.to == "mla" else GQA_METHODS)[0]
        if self.regroup is not None and (self.to == "mla" or method == "mean"):
            raise ValueError(f"regroup={self.regroup!r} applies to to='gqa' / 'mqa' with method 'aligned' or 'pca', "
                             f"not to={self.to!r} with method={method!r}")  # fmt: skip

    def _check_rank_allocation(self) -> None:
        """Default: sensitivity for MLA by kv_budget in a native format (measured best, BENCHMARKS.md), else uniform
        (stock DeepSeek has one rank for all layers)."""
        if self.rank_allocation is None:
            sensitivity = self.to == "mla" and self.kv_budget is not None and self.format != "deepseek_v3"
            self.rank_allocation = "sensitivity" if sensitivity else "uniform"
        _one_of("rank_allocation", self.rank_allocation, RANK_ALLOCATIONS)
        if self.rank_allocation == "sensitivity" and (self.to != "mla" or self.kv_budget is None
                                                      or self.format == "deepseek_v3"):  # fmt: skip
            raise ValueError("rank_allocation='sensitivity' needs to='mla', kv_budget and a native format (stock "
                             "DeepSeek has one kv_lora_rank and one qk_rope_head_dim for all layers)")  # fmt: skip
        if self.rank_allocation == "energy" and (self.to != "mla" or self.kv_budget is None or self.method != "calibrated"
                                                 or self.format == "deepseek_v3"):
            raise ValueError("rank_allocation='energy' needs to='mla', kv_budget, method='calibrated' and a native "
                             "format (stock DeepSeek has one kv_lora_rank)")
