"""The conversion targets (what `to=` names), one module each implementing base.ConversionTarget, and their table.
A new target is its module and one line here (and its name in options' TARGETS)."""

from ..options import TARGETS
from ..options.convert_options import register_targets
from .base import ConversionTarget, LatentChoice, LayerChoice, LayerResult, Plan, Target
from .gqa import GQATarget
from .latent_kv import LatentKVTarget
from .mla import MLATarget

TABLE: dict[str, ConversionTarget] = {t.name: t for t in (
    GQATarget("gqa"),
    GQATarget("mqa", kv_heads=1),  # MQA is GQA with one KV head
    MLATarget(),
    LatentKVTarget(),
)}  # fmt: skip
if tuple(TABLE) != TARGETS:  # the names options offer are the table's
    raise RuntimeError(f"the target table {tuple(TABLE)} and options.TARGETS {TARGETS} differ")
register_targets(TABLE)  # ConvertOptions reads each target's option checks


def target_of(name: str) -> ConversionTarget:
    return TABLE[name]


__all__ = ["TABLE", "ConversionTarget", "LatentChoice", "LayerChoice", "LayerResult", "Plan", "Target", "target_of"]
