"""Writing the output as it is made: tensors into safetensors shards (layer_writer.ShardedWriter, in the staging
folder output.STAGING names, so a killed conversion's leftovers are recognized), then the config, generation
config, tokenizer, conversion_report.json, the model card and healing's curve; the staging folder is renamed onto
OUT only when all is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ...extras import available
from ...hub import model_card
from ...kv_memory import dtype_of
from ..fitting.heal import plot_curve
from ..io.layer_writer import ShardedWriter, state_groups
from ..io.output import STAGING


class OutputWriter:
    """add(tensors) as they come (cast to `dtype` when given); finish(...) completes OUT. A context manager: an
    exception removes the staging folder and leaves OUT as it was."""

    def __init__(self, out: Path, max_shard_size: str, overwrite: bool, dtype: str | None):
        self.dtype = dtype_of(dtype) if dtype is not None else None
        self.writer = ShardedWriter(
            out, max_shard_size, overwrite, prefix=STAGING.format(name=Path(out).name, pid=os.getpid())
        )

    def __enter__(self) -> "OutputWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.writer.__exit__(*exc)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.dtype is not None:
            tensors = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        self.writer.add(tensors)

    def add_model(self, model) -> None:
        """A whole in-memory model's tensors (healing's result), layer by layer."""
        for group in state_groups(model):
            self.add(group)

    def finish(self, config, generation_config, tokenizer, report: dict) -> Path:
        staging = self.writer.staging
        tokenizer.save_pretrained(staging)
        if "heal" in report and available("plot"):  # the held-in curve of healing (matplotlib: optional)
            h = report["heal"]
            plot_curve(h["losses"], h["held_in_kl"], h["best_step"], h["lr"], staging / "heal_curve.png")
        files = {"conversion_report.json": json.dumps(report, indent=2, default=str), "README.md": model_card(report)}
        return self.writer.finish(config, generation_config, files)
