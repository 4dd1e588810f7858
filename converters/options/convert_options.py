"""ConvertOptions, the parsed options of `convert()`: what to convert to, and its sections (calibration,
reconstruction, healing, output: sections.py), frozen dataclasses, each validated on construction.

Each option is declared once, as its field: the default, and in `option(...)` metadata its flat name, help text,
choices and command-line type; FLAT_NAMES, the CLI's --flags (cli.py) and the applied defaults of healing are read
from them. Users give flat names (`convert(..., calib_samples=16)`, `--calib-samples 16`); `ConvertOptions.from_flat`
maps them onto the sections and `flat()` maps back. Errors name the flat name and the value ("calib_samples=1 ..."),
since that is what the user typed. An option that does not apply to the chosen target, method or healing is refused;
the defaults of the options that apply are filled in (those that do not apply stay None).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, fields

from ...devices import resolve_device
from ...kv_memory import dtype_of
from ..export.constants import ENGINES
from ..io.heal_data import MIN_LENGTH as RETRIEVAL_MIN_LENGTH
from .fields import fill, one_of, positive_int, option
from .presets import CONTEXTS, with_preset
from .registry import all_formats, format_refusal, target_names, target_of
from .sections import SECTIONS, CalibrationOptions, HealingOptions, OutputOptions, ReconstructionOptions

logger = logging.getLogger(__name__)

RANK_ALLOCATIONS = ("uniform", "energy", "sensitivity", "retrieval")


def resolved(opts: "ConvertOptions", **changes) -> "ConvertOptions":
    """A copy of validated options with the choices a stage resolved, by flat name (method, reconstruct_steps):
    frozen like the original; not validated again (the stage that resolved them checked them)."""
    out, sections = copy.copy(opts), {}
    for name, value in changes.items():
        place = FLAT_NAMES[name]
        if place is None:
            fill(out, name, value)
        else:
            section = sections.setdefault(place[0], copy.copy(getattr(opts, place[0])))
            fill(section, place[1], value)
    for section, value in sections.items():
        fill(out, section, value)
    return out


def option_fields() -> list[tuple[str, tuple | None, dict]]:
    """(flat name, (section, field) or None for a field of ConvertOptions itself, metadata) of every option, in
    declaration order: ConvertOptions' own fields, then each section's. Choices declared as a function (the targets
    and formats the registry knows) are read now."""
    top = [(f.name, None, f.metadata) for f in fields(ConvertOptions) if f.metadata and f.name not in SECTIONS]
    out = top + [
        (f.metadata["flat"] or f.name, (section, f.name), f.metadata)
        for section, kind in SECTIONS.items()
        for f in fields(kind)
    ]
    return [
        (name, place, {**meta, "choices": meta["choices"]()} if callable(meta.get("choices")) else meta)
        for name, place, meta in out
    ]


@dataclass(frozen=True)
class ConvertOptions:
    """What to convert to, and how. Each section validates itself on construction, then the checks that span
    sections run here (errors name the option and its value)."""

    to: str = option(None, "the target attention (required)", choices=target_names)
    kv_heads: int | None = option(None, "gqa: KV heads after conversion (mqa: 1)", parse=int, targets=("gqa", "mqa"))
    kv_lora_rank: int | None = option(None, "mla: latent dims d_c", parse=int, targets=("mla",))
    rope_dim: int | None = option(
        None,
        "mla: dims of the shared RoPE key (even; default: one head's d_h, at most a third of --kv-budget)",
        parse=int,
        targets=("mla",),
    )
    kv_budget: float | None = option(
        None,
        "mla: fraction of the source's KV bytes (instead of --kv-lora-rank); latent_kv: the same, required",
        parse=float,
        targets=("mla", "latent_kv"),
    )
    key_share: float | None = option(
        None,
        "latent_kv: share of the budget spent on key latents, the rest on values "
        "(default 1/3: values need more rank than keys)",
        parse=float,
        targets=("latent_kv",),
    )
    method: str | None = option(
        None,
        "gqa/mqa: pca (default), aligned or mean; mla: calibrated (default) or mha2mla "
        "(defaults: the best measured, docs/conversion.md)",
    )
    regroup: bool | None = option(
        None,
        "gqa aligned/pca: merge KV heads by index instead of grouping them by similarity (default: grouped)",
        flag="--no-regroup",
        targets=("gqa", "mqa"),
    )
    rank_allocation: str | None = option(
        None,
        "mla with --kv-budget: per layer RoPE dims + rank (or exact) by each "
        "choice's measured KL (default; uniform for deepseek_v3), one rank for all "
        "layers, by retained energy, or copy layers exact; latent_kv: uniform (default), or "
        "retrieval: exact keys for copy KV heads",
        choices=RANK_ALLOCATIONS,
    )
    # a dropped RoPE component costs energy x 2(1 - sinc(theta L)) (mla_plan.py)
    rope_context: int | None = option(
        None,
        "mla: the distances the RoPE split keeps scores right over (default: "
        "--calib-len; the served context keeps far retrieval at some short-range cost); "
        "latent_kv: the distances the key fit weighs (default 4096)",
        parse=int,
        metavar="TOKENS",
        targets=("mla", "latent_kv"),
    )
    format: str = option(
        "auto",
        "auto: stock for llama-family GQA/MQA, else native; deepseek_v3: stock DeepseekV3ForCausalLM (MLA)",
        choices=all_formats,
    )
    engine: str | None = option(
        None,
        "--format deepseek_v3: the engine whose MLA kernels the shapes fit (default "
        "llama.cpp, any shape, with llama.cpp's query LoRA; vllm: 512+64, or 256+64 GPU-only; "
        "sglang: 512+64 or 256+64; flashmla: 512+64)",
        choices=ENGINES,
    )
    seed: int = option(0, "seed of the teacher samples and the fits (default 0)", parse=int)
    device: str = option(
        "auto",
        "where the model passes run (teacher samples, statistics, sensitivity, "
        "reconstruction): auto (default: the first CUDA GPU if any, else cpu), cpu, cuda, cuda:N",
    )
    dtype: str | None = option(None, "dtype of the saved weights (default: the source's)")
    context: str = option(
        "short",
        "long: the long-context recipe (calibration on the shipped general corpus, "
        "retrieval-aware healing; docs/conversion.md), filling every option not given; short "
        "(default): none",
        choices=CONTEXTS,
    )
    calibration: CalibrationOptions = option(factory=CalibrationOptions)
    reconstruction: ReconstructionOptions = option(factory=ReconstructionOptions)
    healing: HealingOptions = option(factory=HealingOptions)
    output: OutputOptions = option(factory=OutputOptions)
    given: tuple = field(default=(), compare=False, repr=False)  # (flat name, value) as the user gave them, in order

    @classmethod
    def from_flat(cls, **options) -> ConvertOptions:
        """From convert()'s flat keywords (FLAT_NAMES), a preset's (`context`) filled in under them; an unknown name
        is a TypeError naming it."""
        unknown = [name for name in options if name not in FLAT_NAMES]
        if unknown:
            raise TypeError(f"unknown conversion option {unknown[0]!r}; the options are {', '.join(FLAT_NAMES)}")
        given = tuple(options.items())
        options = with_preset(options)
        top = {name: v for name, v in options.items() if FLAT_NAMES[name] is None}
        sections = {section: {} for section in SECTIONS}
        for name, value in options.items():
            if FLAT_NAMES[name] is not None:
                section, key = FLAT_NAMES[name]
                sections[section][key] = value
        if top.get("to") is None:
            raise TypeError(f"the conversion option 'to' is required (one of {', '.join(map(repr, target_names()))})")
        return cls(**top, **{section: SECTIONS[section](**kw) for section, kw in sections.items()}, given=given)

    def flat(self) -> dict:
        """The flat options, by FLAT_NAMES (the report's "options"); ConvertOptions.from_flat(**o.flat()) == o."""
        return {
            name: getattr(self if place is None else getattr(self, place[0]), name if place is None else place[1])
            for name, place in FLAT_NAMES.items()
        }

    def __post_init__(self) -> None:
        for section, kind in SECTIONS.items():
            if not isinstance(getattr(self, section), kind):
                raise TypeError(f"{section}={getattr(self, section)!r} is not a {kind.__name__}")
        one_of("to", self.to, target_names())
        one_of("context", self.context, CONTEXTS)
        self._refuse_inapplicable()
        one_of("format", self.format, all_formats())
        target = target_of(self.to)  # its own checks and defaults: converters/targets/
        methods = target.methods
        fill(self, "method", self.method or methods[0])
        if self.method not in methods:
            raise ValueError(f"method={self.method!r} is not one of {methods} for to={self.to!r}")
        target.check_options(self)
        self._check_rank_allocation(target)
        if self.format not in target.formats:  # which targets write it
            raise ValueError(format_refusal(self.format, self.to))
        if self.engine is not None and self.format != "deepseek_v3":
            raise ValueError(f"engine={self.engine!r} applies to format='deepseek_v3' only, not format={self.format!r}")
        if self.format == "deepseek_v3":
            fill(self, "engine", self.engine or "llama.cpp")
            one_of("engine", self.engine, ENGINES)
        target.check_budget(self)
        positive_int("kv_heads", self.kv_heads)
        positive_int("kv_lora_rank", self.kv_lora_rank)
        positive_int("rope_context", self.rope_context)
        if self.rope_dim is not None and (not isinstance(self.rope_dim, int) or self.rope_dim < 0 or self.rope_dim % 2):
            raise ValueError(f"rope_dim={self.rope_dim!r} must be an even non-negative integer")
        if self.dtype is not None:
            dtype_of(self.dtype)  # raises naming the value
        resolve_device(self.device)  # raises naming the value
        heal = self.healing
        if heal.steps and self.calibration.lengths:  # healing's whole-model passes read plain windows
            raise ValueError(f"calib_lengths={self.calibration.lengths!r} does not apply with heal_steps")
        if heal.steps and heal.length is None:
            fill(heal, "length", self.calibration.length)
        if heal.steps and heal.data == "retrieval" and heal.length < RETRIEVAL_MIN_LENGTH:  # before any work
            raise ValueError(
                f"heal_len={heal.length}: heal_data='retrieval' needs windows of at least "
                f"{RETRIEVAL_MIN_LENGTH} tokens (--heal-len)"
            )
        if (
            self.calibration.propagate or self.reconstruction.steps or heal.steps and heal.layerwise_steps
        ) and self.calibration.samples < 2:
            raise ValueError(
                f"calib_samples={self.calibration.samples!r}: propagate / reconstruct_steps / "
                "heal_layerwise_steps hold one window in, so they need at least 2"
            )

    def _refuse_inapplicable(self) -> None:
        """An option the chosen target or method would ignore is an error (it was given for a reason): each option
        declares the targets it belongs to (`option(targets=...)`), and one check refuses it for any other."""
        for name, _, metadata in option_fields():
            owners = metadata.get("targets")
            if owners is not None and self.to not in owners and getattr(self, name) is not None:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} applies to to={' / '.join(map(repr, owners))} only, "
                    f"not to={self.to!r}"
                )
        rec = self.reconstruction
        if rec.attention_kl and rec.steps == 0 and not self.calibration.propagate:
            raise ValueError(f"reconstruct_attention_kl={rec.attention_kl!r} needs reconstruct_steps > 0 or propagate")

    def _check_rank_allocation(self, target) -> None:
        """Default: the target's (MLA by kv_budget in a native format: sensitivity, measured best; else uniform),
        then the target's checks of the choice."""
        if self.rank_allocation is None:
            fill(self, "rank_allocation", target.default_rank_allocation(self))
        one_of("rank_allocation", self.rank_allocation, RANK_ALLOCATIONS)
        target.check_rank_allocation(self)


def targets_of(name: str) -> tuple[str, ...]:
    """The targets a top-level option belongs to (every target when it declares none)."""
    return next(f.metadata["targets"] for f in fields(ConvertOptions) if f.name == name) or target_names()


# Every flat option name (convert()'s keywords, the CLI's --flags, the report's "options") -> (section, field), or
# None for a field of ConvertOptions itself; read from the fields' metadata.
FLAT_NAMES = {flat: place for flat, place, _ in option_fields()}
