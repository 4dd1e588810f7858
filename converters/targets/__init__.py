"""The conversion targets (what `to=` names), one module each implementing base.ConversionTarget and registering
itself at its end (options/registry.py: `register_target`). A new target is its module and one import line here;
importing the modules registers them, in this order (the order `to`'s choices are listed in)."""

from ..options.registry import register_target, target_names, target_of
from . import gqa, mla, latent_kv  # noqa: F401  (each registers its targets)
from .base import ConversionTarget, LatentChoice, LayerChoice, LayerResult, Plan, Target

__all__ = [
    "ConversionTarget",
    "LatentChoice",
    "LayerChoice",
    "LayerResult",
    "Plan",
    "Target",
    "register_target",
    "target_names",
    "target_of",
]
