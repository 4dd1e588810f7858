"""The sections of the conversion options (calibration, reconstruction, healing, output): frozen dataclasses, each
validated on construction (convert_options.py gathers them into ConvertOptions)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from transformers.utils.hub import convert_file_size_to_int

from ...extras import available, require
from ...hub import check_repo_id
from ..fitting.heal_fsdp import launch_mode
from ..fitting.reconstruct import TARGETS as RECONSTRUCT_TARGETS
from ..io.calibration import CALIB_SOURCES, is_dataset_source
from ..io.packing import parse_lengths
from .fields import fill, flat_name, float_or_auto, int_or_auto, non_negative_int, one_of, option, positive_int

logger = logging.getLogger(__name__)

HEAL_DATA = ("calib", "teacher", "mix", "retrieval")


@dataclass(frozen=True)
class CalibrationOptions:
    """The activations the closed forms are fitted to: `samples` windows of `length` tokens (flat names calib_*)."""

    data: str | None = option(
        None,
        "text file, folder of .txt files, a datasets dataset (save_to_disk folder, "
        ".json/.jsonl/.parquet/.csv, name[:config]), or a shipped corpus: general (encyclopedic; "
        "the default of --context long) or stories (the default otherwise)",
        flat="calib_data",
    )
    split: str = option("train", "datasets: the split to read (default train)", flat="calib_split")
    column: str = option("text", "datasets: the text column (default text)", flat="calib_column")
    # SmolLM2 MLA 50%: 32 vs 16 lowers the held-in teacher KL after reconstruction (BENCHMARKS)
    samples: int = option(32, "calibration windows (default 32)", flat="calib_samples", parse=int)
    length: int = option(256, "tokens per calibration window (default 256)", flat="calib_len", parse=int)
    lengths: str | None = option(
        None,
        "sample lengths packed into each window, summing to --calib-len (positions restart per sample)",
        flat="calib_lengths",
        metavar="L1,L2,...",
    )
    source: str = option(
        "teacher",
        "calibration windows: samples of the source itself (default; prompted by each "
        "text window's first 4 tokens, temperature 1, top-p 0.95, --seed), or the calibration text",
        flat="calib_source",
        choices=CALIB_SOURCES,
    )
    propagate: bool = option(
        False,
        "recompute each layer's closed form from the converted layers' statistics (kept "
        "where it lowers the held-in error; measured no better: off by default)",
        flag="--propagate",
    )

    def __post_init__(self) -> None:
        one_of("calib_source", self.source, CALIB_SOURCES)
        positive_int("calib_samples", self.samples)
        positive_int("calib_len", self.length)
        if self.lengths is not None:
            parse_lengths(self.lengths, self.length)
        if self.data is not None and is_dataset_source(self.data):
            require("convert", f"calib_data={self.data!r} (a datasets dataset)")


@dataclass(frozen=True)
class ReconstructionOptions:
    """Adam steps fitting each converted layer's output after its closed form (flat names reconstruct_*)."""

    steps: int | str = option(
        "auto",
        "Adam steps fitting each converted attention layer's output to the source's, "
        "layer by layer (default auto: 60 when the conversion keeps at least half the source's "
        "KV values, 150 below; 0: closed form only)",
        flat="reconstruct_steps",
        parse=int_or_auto,
    )
    lr: float = option(
        1e-2,
        "reconstruction step, a fraction of each weight's RMS (default 0.01; SmolLM2: best held-in)",
        flat="reconstruct_lr",
        parse=float,
    )
    target: str = option(
        "source",
        "fit to the source layer on the source's inputs (default) or on the converted prefix's",
        flat="reconstruct_target",
        choices=RECONSTRUCT_TARGETS,
    )
    attention_kl: float = option(
        0.0,
        "add WEIGHT x the KL of each head's attention pattern to the source's to the "
        "reconstruction's objective, so sharp retrieval attention counts (default 0: the "
        "output error alone)",
        flat="reconstruct_attention_kl",
        parse=float,
        metavar="WEIGHT",
    )

    def __post_init__(self) -> None:
        if self.steps != "auto":
            non_negative_int("reconstruct_steps", self.steps)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"reconstruct_lr={self.lr!r} must be a positive number")
        one_of("reconstruct_target", self.target, RECONSTRUCT_TARGETS)
        if (
            isinstance(self.attention_kl, bool)
            or not isinstance(self.attention_kl, (int, float))
            or self.attention_kl < 0
        ):
            raise ValueError(f"reconstruct_attention_kl={self.attention_kl!r} must be a non-negative number")


@dataclass(frozen=True)
class HealingOptions:
    """Distillation from the source after conversion (flat names heal_*, checkpoint_dir / checkpoint_every, resume)."""

    # Healing applies with steps > 0; the other fields must then stay unset (None / False) and get `applied`.
    steps: int = option(
        0, "distillation steps from the source after conversion (default 0: none)", flat="heal_steps", parse=int
    )
    lr: float | str | None = option(
        None,
        "healing learning rate, or auto (default): a short range test on held-in windows",
        flat="heal_lr",
        parse=float_or_auto,
        applied="auto",
    )
    data: str | None = option(
        None,
        "healing text: samples from the source model (default), the calibration text, "
        "both, or retrieval: calibration text that asks for what it read far back (repeated "
        "segments, recalled facts; docs/conversion.md)",
        flat="heal_data",
        choices=HEAL_DATA,
        applied="teacher",
    )
    held_in: int | None = option(
        None,
        "windows held out of healing; the best state on them is returned (default 4)",
        flat="heal_held_in",
        parse=int,
        applied=4,
    )
    batch_size: int | None = option(
        None, "windows per healing step (default 4)", flat="heal_batch_size", parse=int, applied=4
    )
    length: int | None = option(
        None,
        "tokens per healing window (default: --calib-len; long ones train retrieval over them: docs/conversion.md)",
        flat="heal_len",
        parse=int,
        metavar="TOKENS",
    )
    train: str | None = option(
        None,
        "what healing updates: the converted attention layers (default) or every weight",
        flat="heal_train",
        choices=("attention", "all"),
        applied="attention",
    )
    layerwise_steps: int | None = option(
        None,
        "healing's first stage: Adam steps per decoder layer matching its output "
        "to the source's on the calibration windows, layer by layer (default 40; "
        "0: none)",
        flat="heal_layerwise_steps",
        parse=int,
        applied=40,
    )
    checkpoint_dir: str | None = option(
        None, "save the healing state here (with --checkpoint-every N)", flat="checkpoint_dir"
    )
    checkpoint_every: int = option(0, "healing steps between saved states", flat="checkpoint_every", parse=int)
    resume: bool = option(False, "continue healing from --checkpoint-dir", flat="resume", flag="--resume")

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ValueError(f"heal_steps={self.steps!r} must be a non-negative integer")
        applied = {f.name: f.metadata["applied"] for f in fields(self) if f.name not in ("steps", "checkpoint_every")}
        if not self.steps:
            given = [n for n in applied if getattr(self, n) not in (None, False)]
            if given:  # it was given for a reason: healing would have used it
                raise ValueError(
                    f"{flat_name(self, given[0])}={getattr(self, given[0])!r} applies to healing "
                    f"only: set heal_steps (--heal-steps N)"
                )
        else:
            for name, value in applied.items():
                if getattr(self, name) is None:
                    fill(self, name, value)
            one_of("heal_train", self.train, ("attention", "all"))
            if self.lr != "auto" and (isinstance(self.lr, (str, bool)) or not self.lr > 0):
                raise ValueError(f"heal_lr={self.lr!r} must be a positive number or 'auto'")
            one_of("heal_data", self.data, HEAL_DATA)
            positive_int("heal_batch_size", self.batch_size)
            positive_int("heal_held_in", self.held_in)
            positive_int("heal_len", self.length)
            non_negative_int("heal_layerwise_steps", self.layerwise_steps)
        if (self.resume or self.checkpoint_every) and self.checkpoint_dir is None:
            raise ValueError("resume / checkpoint_every need checkpoint_dir")
        non_negative_int("checkpoint_every", self.checkpoint_every)
        if self.steps:
            launch_mode()  # a distributed launch healing cannot use (DeepSpeed, FSDP1) is refused before any work
            if not available("plot"):
                logger.warning(
                    "matplotlib is not installed: the healed model is written without heal_curve.png "
                    "(pip install 'hf-attn-patch[plot]')"
                )


@dataclass(frozen=True)
class OutputOptions:
    """How the finished folder is written and published."""

    overwrite: bool = option(False, "replace OUT if it exists", flat="overwrite", flag="--overwrite")
    max_shard_size: str = option(
        "2GB", "split weights above this size into shards with an index (default 2GB)", flat="max_shard_size"
    )
    push_to_hub: str | None = option(
        None, "owner/name: upload OUT when the conversion is done", flat="push_to_hub", metavar="REPO"
    )
    private: bool = option(False, "with --push-to-hub: a private repo", flat="private", flag="--private")

    def __post_init__(self) -> None:
        try:  # checked now: save_pretrained would only find out after converting and healing
            shard_bytes = convert_file_size_to_int(self.max_shard_size)
        except (ValueError, TypeError):
            shard_bytes = 0
        if shard_bytes <= 0:
            raise ValueError(
                f"max_shard_size={self.max_shard_size!r}: expected a positive size such as '2GB' or '500MB'"
            )
        if self.push_to_hub is not None:
            try:
                check_repo_id(self.push_to_hub)
            except ValueError:
                raise ValueError(f"push_to_hub={self.push_to_hub!r} must look like 'owner/name'") from None


SECTIONS = {
    "calibration": CalibrationOptions,
    "reconstruction": ReconstructionOptions,
    "healing": HealingOptions,
    "output": OutputOptions,
}
