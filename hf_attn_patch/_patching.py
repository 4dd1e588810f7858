"""The one place that changes transformers: a table of what is replaced. Each replacement lives with its feature;
`patch()` installs the rows in order and records every original, `unpatch()` puts each one back (`is`-identical,
names that were not in a registry removed again).

A row (owner, name, make, why): `make(current)` returns the object to put at `owner.name` (an attribute of a module
or class, or a key of a registry dict); `current` is what is there now (MISSING for a new registry key), so two
rows on one name stack (the second wraps the first). Official hooks (AttentionInterface / AttentionMaskInterface
registration) are rows too, so unpatch removes them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

from transformers.configuration_utils import PreTrainedConfig
from transformers.generation import configuration_utils as generation_config_module
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from .attention.backend import interface_in_context
from .compat import patch_rows
from .cache.generate_hook import prefill_with_paged, prepare_cache_with_paged, with_paged_cache_name
from .attention.backend import PAGED_ATTENTION, paged_attention_forward
from .attention.state_layers import mixer_classes, per_sequence_forward
from .grammar.generate_hook import generate_with_grammar
from .models import ARCHITECTURES
from .models import fast_linear
from .models.construction_hooks import attention_dispatch, validating_post_init
from .speculative.feature_drafter import MODEL_TYPE as DRAFTER_TYPE
from .speculative.feature_drafter import FeatureDrafterConfig, FeatureDrafterForCausalLM
from .speculative.generate_hook import assisted_decoding_any_batch, generate_with_speculative_options

logger = logging.getLogger(__name__)

MISSING = object()  # a registry key that did not exist before patch()


@dataclass(frozen=True)
class Patch:
    owner: object  # module, class or registry dict
    name: str
    make: Callable[[object], object]  # current object (or MISSING) -> the replacement
    why: str  # what no official hook does


def registered(value) -> Callable[[object], object]:
    """`make` of a registry row: put `value` under a new name."""
    return lambda current: value


def patch_table() -> list[Patch]:
    """Every replacement, in installation order."""
    rows = [
        Patch(
            arch.attention_module(),
            arch.attention_class,
            lambda original, arch=arch: attention_dispatch(original, arch),
            "decoder layers look the attention class up by name; no registry for attention modules",
        )
        for arch in ARCHITECTURES.values()
    ] + [
        Patch(
            mixer,
            "forward",
            per_sequence_forward,
            "constant-state layers run per sequence of the engine's packed row, each with its own state",
        )
        for mixer in mixer_classes()
    ]
    generation = GenerationMixin
    return (
        rows
        + [
            Patch(
                PreTrainedConfig,
                "__post_init__",
                validating_post_init,
                "validate attention_variant and its fields when a config is built",
            ),
            Patch(
                PreTrainedModel,
                "post_init",
                fast_linear.with_fast_linears,
                "a model's nn.Linear layers run packed CPU weights (models/fast_linear.py); no hook for modules",
            ),
            Patch(
                generation_config_module,
                "ALL_CACHE_IMPLEMENTATIONS",
                with_paged_cache_name,
                "cache names are a fixed tuple: add 'paged_kv'",
            ),
            Patch(
                generation,
                "_prepare_cache_for_generation",
                prepare_cache_with_paged,
                "build a PagedKVCache for cache_implementation='paged_kv'",
            ),
            Patch(
                generation,
                "_prefill",
                prefill_with_paged,
                "tell a PagedKVCache each row's padding and prefix hits before the prefill forward",
            ),
            Patch(
                generation,
                "_assisted_decoding",
                assisted_decoding_any_batch,
                "speculative decoding for every batch size",
            ),
            Patch(
                generation,
                "generate",
                generate_with_grammar,
                "generate() rejects unknown keywords: response_format= / grammar= become a logits processor",
            ),
            Patch(
                generation,
                "generate",
                generate_with_speculative_options,
                "generate() rejects unknown keywords: speculative_stats= / draft_length= reach the speculative loop",
            ),
            Patch(
                AttentionInterface._global_mapping,
                PAGED_ATTENTION,
                registered(paged_attention_forward),
                "attention that reads the paged blocks itself (official hook)",
            ),
            Patch(
                AttentionMaskInterface._global_mapping,
                PAGED_ATTENTION,
                registered(sdpa_mask),
                "its mask function (official hook; without one, padded batches would silently get mask=None)",
            ),
            Patch(
                CONFIG_MAPPING._extra_content,
                DRAFTER_TYPE,
                registered(FeatureDrafterConfig),
                "AutoConfig reads a feature drafter's config.json (AutoConfig.register's registry)",
            ),
            Patch(
                MODEL_FOR_CAUSAL_LM_MAPPING._extra_content,
                FeatureDrafterConfig,
                registered(FeatureDrafterForCausalLM),
                "AutoModelForCausalLM loads a feature drafter (AutoModelForCausalLM.register's registry)",
            ),
            Patch(
                AttentionInterface,
                "get_interface",
                interface_in_context,
                "inside a forward context (the engine's step) every attention lookup returns the paged backend",
            ),
        ]
        + [Patch(*row) for row in patch_rows()]
    )


@dataclass(frozen=True)
class Applied:
    patch: Patch
    original: object  # what was at owner.name before this row (MISSING for a new registry key)
    installed: object  # what this row put there


_applied: list[Applied] = []


def _get(owner, name: str):
    if isinstance(owner, dict):
        return owner.get(name, MISSING)
    return vars(owner).get(name, MISSING)


def _set(owner, name: str, value) -> None:
    if isinstance(owner, dict):
        if value is MISSING:
            owner.pop(name, None)
        else:
            owner[name] = value
    elif value is MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, value)


def patch() -> None:
    """Install the table (idempotent)."""
    if _applied:
        return
    for row in patch_table():
        original = _get(row.owner, row.name)
        installed = row.make(original)
        _set(row.owner, row.name, installed)
        _applied.append(Applied(row, original, installed))
    fast_linear.resume()  # layers unpatch() turned back into nn.Linear
    logger.debug("hf_attn_patch: patched %d objects", len(_applied))


def unpatch() -> None:
    """Put every replaced object back, last row first (idempotent). Models built while patched keep their attention
    modules; their FastLinear layers become nn.Linear again until the next patch()."""
    fast_linear.suspend()
    while _applied:
        row = _applied.pop()
        _set(row.patch.owner, row.patch.name, row.original)


@contextlib.contextmanager
def unpatched():
    """Within the block transformers is stock (e.g. to build a reference model); the patch is restored after."""
    was_patched = is_patched()
    unpatch()
    try:
        yield
    finally:
        if was_patched:
            patch()


def is_patched() -> bool:
    return bool(_applied)


def applied() -> list[Applied]:
    """Each installed row with its original and its replacement, in installation order; for tests and debugging."""
    return list(_applied)
