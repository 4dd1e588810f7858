"""What the conversion makes of each layer, decided from the source's config and the options before any weight is
read: the output format here, the sizes by the target (converters/targets/: GQA / MQA KV heads, MLA latent rank d_c
and shared RoPE dims d_r with the export's shape, latent K/V key and value ranks), and the choices the options leave
to the source (method with per-head q/k norms, reconstruct_steps "auto"), returned as Target.options (the options
are frozen)."""

from __future__ import annotations

import logging

from ..options import ConvertOptions
from ..targets import target_of
from ..targets.base import AUTO_RECONSTRUCT_STEPS, Target, auto_reconstruct_steps  # noqa: F401  (the stage's result)
from .source import Source

logger = logging.getLogger(__name__)


def resolve_target(source: Source, opts: ConvertOptions) -> Target:
    """The Target, with the resolved options: method (GQA with per-head q/k norms: 'mean', unless the user named
    another: refused) and reconstruct_steps ("auto": by the KV share kept)."""
    config, dims = source.config, source.shape
    arch = dims.arch
    if arch.replaces_stock:
        raise ValueError(f"model_type={config.model_type!r} is already MLA: there is nothing to convert")
    target = target_of(opts.to)
    return target.resolve(source, opts, target.stock_format(config, opts))
