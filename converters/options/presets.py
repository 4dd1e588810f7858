"""Presets: one flag for a whole recipe. `context="long"` (`--context long`) fills every option of the long-context
recipe that the user did not give; whatever the user gives wins.

The long-context recipe keeps what the model read far back (docs/conversion.md, "Long context"): a closed form
calibrated on general text (the shipped encyclopedic corpus, `calib_data="general"`: the text a general model reads
carries retrieval to other domains, where children's stories did not; docs/conversion.md gives the measurements)
without reconstruction, then retrieval-aware healing on the same text (io/heal_data.py: repeated segments, recalled
facts, plain text; the KL weighted on the positions that retrieve) of HEAL_STEPS single 1,024-token windows at
lr 2e-5, the rate with which both latent K/V and MLA lowered their held-in KL (a larger one diverged on the
unbalanced factors; BENCHMARKS.md). MLA also scores its RoPE split over 4,096 tokens (the served distances, not the
calibration windows) and spends one rank on every layer (the per-layer sensitivity search costs more than the
healing on a CPU, and the served deepseek_v3 shape needs one rank anyway).
"""

from __future__ import annotations

from .fields import one_of
from .registry import target_names, target_of

CONTEXTS = ("short", "long")
LONG_CONTEXT = {"calib_data": "general", "calib_source": "text", "reconstruct_steps": 0, "heal_steps": 60,
                "heal_data": "retrieval", "heal_len": 1024, "heal_lr": 2e-5, "heal_batch_size": 1, "heal_held_in": 4,
                "heal_layerwise_steps": 0}  # fmt: skip


def with_preset(options: dict) -> dict:
    """The flat options with the preset named by options["context"] filled in under the user's own: the recipe's
    options, then the target's own (its `long_context`)."""
    context = options.get("context", "short")
    one_of("context", context, CONTEXTS)
    if context == "short":
        return options
    to = options.get("to")
    own = target_of(to).long_context if to in target_names() else {}  # an unknown `to` is refused with the options
    return {**LONG_CONTEXT, **own, **options}
