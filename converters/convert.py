"""`convert()`: a checkpoint in, a GQA / MQA / MLA checkpoint out, optionally healed by distillation.

The source is read one decoder layer at a time (stages/source.py) and never modified; the stages run in order,
each with a typed result (converters/stages/__init__.py lists them), and the converted layers are written into the
output's safetensors shards as they finish: peak memory is the resident parts (embeddings, final norm, LM head),
about two layers and the carried calibration activations, whatever the depth (docs/conversion.md, "Memory and
scale"). Healing (heal_steps > 0) distills end to end, on whole models. The output folder is written into a
staging sibling and renamed when complete; it holds safetensors weights, the config, the tokenizer, the generation
config, conversion_report.json and a model card.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch

from ..hub import push
from ..models import fast_linear
from .options import ConvertOptions
from .io.output import check_output
from .stages.layers import convert_layers, write_native
from .stages.heal import heal_whole
from .stages.plan import plan_layers
from .stages.report import Clock, build_report
from .stages.source import open_source
from .stages.target import resolve_target
from .stages.windows import calibrate
from .stages.write import OutputWriter

logger = logging.getLogger(__name__)


@fast_linear.disabled()  # a conversion's numbers never depend on the CPU inference fast path (models/fast_linear.py)
def convert(source: str, out: str | os.PathLike, hub_client=None, **options) -> dict:
    """Convert `source` and write the result to `out`; returns the conversion report (also in the output folder).
    With push_to_hub="owner/name" the finished folder is uploaded (`hub_client`: a huggingface_hub.HfApi stand-in)."""
    opts = ConvertOptions.from_flat(**options)
    out = Path(out)
    check_output(source, out, opts.output.overwrite)  # the source is checked by open_source, before any weight
    torch.manual_seed(opts.seed)
    src = open_source(source, opts.device)
    clock = Clock(src.device)
    target = clock.run("target", resolve_target, src, opts)  # refuses a bad source before any weight
    opts = target.options  # with the choices resolved from the source (frozen, as the user's)
    clock.run("resident", src.layers.load_resident)
    cal = clock.run("calibration", calibrate, src, opts, target.needs_stats)
    plan = clock.run("plan", plan_layers, src, opts, target, cal.windows)
    out_opts = opts.output
    with OutputWriter(out, out_opts.max_shard_size, out_opts.overwrite, opts.dtype) as writer:
        healed = None
        if opts.healing.steps:
            with tempfile.TemporaryDirectory(prefix="hf-attn-native-") as tmp:
                layers = clock.run("layers", write_native, src, opts, target, cal.windows, plan, Path(tmp) / "native")
                healed = clock.run(
                    "heal", heal_whole, src, Path(tmp) / "native", opts, cal.windows, plan.stride, target.export_rope
                )
            if target.stock_format:
                del healed.model.config.attention_variant  # a plain config: our module's names are the stock ones
            config = healed.model.config
            clock.run("write", writer.add_model, healed.model)
        else:
            layers = clock.run("layers", convert_layers, src, opts, target, cal.windows, plan, writer.add)
            config = layers.config
        if opts.dtype is not None:
            config.dtype = opts.dtype
        report = build_report(src, opts, target, cal, plan, layers, healed, config, clock)
        if not _is_main_process():  # under torchrun / accelerate launch every process converts and heals; one writes
            return report
        writer.finish(config, src.generation_config, src.tokenizer, report)
    logger.info("converted %s -> %s (%s, %s)", source, out, opts.to, opts.method)
    if out_opts.push_to_hub is not None:
        report["hub"] = push(out, out_opts.push_to_hub, private=out_opts.private, client=hub_client)
    return report


def _is_main_process() -> bool:
    """Rank 0 of a distributed launch (torchrun and accelerate launch set RANK), or a plain single process."""
    return int(os.environ.get("RANK", "0")) == 0
