"""Constant-state layers (short conv, gated delta net, Mamba2, Mamba1) under the engine's packed forward.

The engine runs many sequences' new tokens as one row [1, T, D]. A state layer's stock forward would run a conv
and a recurrence across that row, mixing sequences, and it has no cache there (the engine calls the model without
one). While a forward context with `states` (cache/metadata.py) is set, the wrapper below runs the layer's own forward
once per sequence on its slice query_start_loc[b]:query_start_loc[b+1] with that sequence's transformers Cache,
and puts the outputs back in place in [1, T, D]; the sequences that decode one token (with a state) run as one
batch [B, 1, D] over their stacked states (copied back after), the layer's own batched one-token step. Outside
the context (generate(), a plain forward, another thread) the stock forward runs untouched. The wrapper is one
row per class in _patching.py's table (unpatch() restores it).

STATE_MIXERS lists the mixer classes the engine serves, each tested token-identical to generate() with chunked
prefill (Jamba's Mamba1: whole prefills; tests/test_engine_hybrid.py); `check_state_layers` refuses a model whose
state layers are not among them.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
from typing import NamedTuple

import torch

from ..cache.manager import STATE
from ..cache.metadata import get_forward_context
from ..cache.state_pool import stack_layer_states, unstack_layer_states
from ..compat import CACHE_ARGUMENTS

__all__ = ["STATE_MIXERS", "check_state_layers", "mixer_classes", "per_sequence_forward"]


class Mixer(NamedTuple):
    """A state-layer class: forward(hidden_states [B, T, D], <cache>, attention_mask) -> [B, T, D]."""

    module: str  # transformers modeling module
    name: str  # class name
    continues_chunks: bool = True  # False: its multi-token path ignores a previous state (no chunked prefill)


_MODELING = "transformers.models.{0}.modeling_{0}"
STATE_MIXERS = {  # model_type -> mixer
    "lfm2": Mixer(_MODELING.format("lfm2"), "Lfm2ShortConv"),  # short conv
    "lfm2_moe": Mixer(_MODELING.format("lfm2_moe"), "Lfm2MoeShortConv"),
    "qwen3_next": Mixer(_MODELING.format("qwen3_next"), "Qwen3NextGatedDeltaNet"),  # gated delta net
    "qwen3_5_text": Mixer(_MODELING.format("qwen3_5"), "Qwen3_5GatedDeltaNet"),
    "olmo_hybrid": Mixer(_MODELING.format("olmo_hybrid"), "OlmoHybridGatedDeltaNet"),
    "bamba": Mixer(_MODELING.format("bamba"), "BambaMixer"),  # Mamba2
    "granitemoehybrid": Mixer(_MODELING.format("granitemoehybrid"), "GraniteMoeHybridMambaLayer"),
    # Mamba1: its sequence scan starts from a zero state ("initial state not supported"), so whole prefills only
    "jamba": Mixer(_MODELING.format("jamba"), "JambaMambaMixer", continues_chunks=False),
}


def mixer_classes() -> list[type]:
    """The classes of STATE_MIXERS (imports their modeling modules)."""
    return [getattr(importlib.import_module(m.module), m.name) for m in STATE_MIXERS.values()]


def per_sequence_forward(original):
    """Wrap a mixer's forward: per sequence of the forward context's `states`, its slice with its own Cache."""
    parameters = list(inspect.signature(original).parameters)
    hidden_name = parameters[1]
    (cache_name,) = [p for p in parameters if p in CACHE_ARGUMENTS]

    def forward(self, *args, **kwargs):
        context = get_forward_context()
        states = context.states if context is not None and context.route else None
        if states is None:
            return original(self, *args, **kwargs)
        bound = dict(zip(parameters[1:], args), **kwargs)
        hidden = bound.pop(hidden_name)
        bound.pop(cache_name, None)  # the engine calls the model without a cache
        bound["attention_mask"] = None  # no padding inside a sequence's slice
        layer, lens = self.layer_idx, context.metadata.query_lens
        starts = list(itertools.accumulate(lens, initial=0))  # host copy of query_start_loc
        decodes = [b for b, n in enumerate(lens) if n == 1 and states[b].has_previous_state(layer)]
        decodes = decodes if len(decodes) > 1 else []
        pieces = []  # (rows of the packed row, their outputs [rows, D])
        if decodes:
            caches = [states[b] for b in decodes]
            joint = stack_layer_states(caches, layer)
            rows = torch.tensor([starts[b] for b in decodes], device=hidden.device)
            out = original(self, hidden[0, rows][:, None], **{cache_name: joint}, **bound)  # [B, 1, D]
            unstack_layer_states(joint, caches, layer)
            pieces.append((rows, out[:, 0]))
        for b in sorted(set(range(len(lens))) - set(decodes)):
            out = original(self, hidden[:, starts[b] : starts[b] + lens[b]], **{cache_name: states[b]}, **bound)
            pieces.append((slice(starts[b], starts[b] + lens[b]), out[0]))
        result = pieces[0][1].new_empty((1, hidden.shape[1], pieces[0][1].shape[-1]))
        for rows, out in pieces:
            result[0, rows] = out
        return result

    forward.__wrapped__ = original
    forward.runs_per_sequence = True
    return forward


def check_state_layers(model, layer_groups, chunked_prefill: bool = True) -> dict[int, torch.nn.Module]:
    """{layer index: mixer module} for every constant-state layer of `model`; ValueError naming the layer type
    when one is not a mixer the engine serves (or chunked_prefill when it cannot continue a prompt chunk),
    RuntimeError when the wrapper is not installed (unpatch())."""
    config = model.config.get_text_config(decoder=True)
    classes = tuple(mixer_classes())
    mixers = {m.layer_idx: m for m in model.modules() if isinstance(m, classes) and hasattr(m, "layer_idx")}
    kinds = getattr(config, "layer_types", None) or ["?"] * len(layer_groups)
    for idx, group in enumerate(layer_groups):
        if group == STATE and idx not in mixers:
            raise ValueError(
                f"Engine: layer {idx} of {config.model_type!r} is a {kinds[idx]!r} layer, which the "
                f"engine does not serve (the state layers of {sorted(STATE_MIXERS)} only)"
            )
    whole = {m.name for m in STATE_MIXERS.values() if not m.continues_chunks}
    for idx, mixer in mixers.items():
        if chunked_prefill and type(mixer).__name__ in whole:
            raise ValueError(
                f"Engine: chunked_prefill=True, but layer {idx} ({type(mixer).__name__}) cannot start a "
                "prompt chunk from a state (transformers' scan starts from zeros); use "
                "chunked_prefill=False"
            )
        if not getattr(type(mixer).forward, "runs_per_sequence", False):
            raise RuntimeError("Engine: hf_attn_patch is unpatched (unpatch() was called); call hf_attn_patch.patch()")
    return mixers
