"""Per-sequence state of constant-state layers (SSM, linear attention, short conv) in hybrid models.

A constant-state layer keeps no K/V per token: it carries a conv state (the last kernel-1 inputs) and / or a
recurrent state of fixed size per sequence. Ownership is split as for the paged KV:
- `StateSlots` (held by the KV manager): which slot each live sequence holds. A slot is taken when the sequence
  enters the manager (`KVManager.add`) and returned when it leaves (`free`: finish, abort, preemption); a
  preempted sequence restarts from position 0 with an empty state (recompute, like its blocks).
- `StateStorage` (held by the storage owner, the engine's runner): per slot one transformers `Cache` whose state
  layers are transformers' own `LinearAttentionLayer`s (a placeholder at attention layers, which never see it), so
  each model's own mixer code reads and writes it as it does under generate(). The storage is reset whenever a
  sequence starts at position 0 in a slot.
- `ForwardContext.states` (cache/metadata.py): per sequence of the forward (query_start_loc order), its Cache;
  the state-layer wrapper (attention/state_layers.py) runs each sequence's slice of the packed row with it.
- `stack_layer_states` / `unstack_layer_states`: one layer's states of several decoding sequences stacked on the
  batch dimension (one batched call of the layer's one-token step) and copied back.

Not supported: prefix hits (a state is not block-wise; the manager turns prefix caching off), forks (copy-on-write
of a state: `KVManager.fork` refuses) and rollback (`crop`: a recurrent state cannot be cut back).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from ..compat import placeholder_cache_layer


__all__ = ["StateSlots", "StateStorage", "stack_layer_states", "unstack_layer_states"]


class StateSlots:
    """A fixed set of slots 0..num_slots-1, one per live sequence. Invariant: each slot is free or held by
    exactly one sequence."""

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
            raise ValueError(f"state slots: num_slots={num_slots!r} must be a positive integer")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest free slot
        self.owner: dict = {}  # seq_id -> slot

    def allocate(self, seq_id) -> int:
        if seq_id in self.owner:
            raise ValueError(f"state slots: sequence {seq_id!r} already holds slot {self.owner[seq_id]}")
        if not self._free:
            raise RuntimeError(
                f"state slots: all {self.num_slots} slots are held (more live sequences than max_num_seqs)"
            )
        slot = self.owner[seq_id] = self._free.pop()
        return slot

    def free(self, seq_id) -> None:
        slot = self.owner.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot(self, seq_id) -> int:
        return self.owner[seq_id]

    def num_free(self) -> int:
        return len(self._free)

    def num_live(self) -> int:
        return len(self.owner)


class StateStorage:
    """Per slot a transformers Cache for one sequence (batch 1): `LinearAttentionLayer` at each state layer of
    `config` (its states are allocated by the layer at first use, then reused by later sequences in the slot)."""

    def __init__(self, config, num_slots: int):
        self.layer_types, self.layer_kwargs = get_layer_types_and_kwargs(config)
        self._caches: list[Cache | None] = [None] * num_slots

    def cache(self, slot: int, fresh: bool) -> Cache:
        """The slot's Cache; fresh=True (the sequence starts at position 0) empties it first."""
        cache = self._caches[slot]
        if cache is None:
            layers = [
                DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)
                if kind in ("conv", "linear_attention")
                else placeholder_cache_layer()
                for kind, kwargs in zip(self.layer_types, self.layer_kwargs)
            ]
            cache = self._caches[slot] = Cache(layers=layers)
        elif fresh:
            for layer in cache.layers:
                if isinstance(layer, LinearAttentionCacheLayerMixin):
                    layer.reset()  # zeros the states and clears has_previous_state
        return cache


def stack_layer_states(caches: list[Cache], layer: int) -> Cache:
    """A Cache whose `layer` holds that layer's states of `caches` (each batch 1, each with a previous state)
    concatenated on the batch dimension: conv [B, C, K], recurrent [B, ...]."""
    parts = [cache.layers[layer] for cache in caches]
    first = parts[0]
    joint = type(first)(number_of_states=first.number_of_states)
    joint.device, joint.dtype = first.device, first.dtype
    for i in range(first.number_of_states):
        joint.conv_kernel_size[i] = first.conv_kernel_size[i]
        joint.has_previous_state[i] = True
        if first.is_conv_states_initialized[i]:
            joint.conv_states[i] = torch.cat([part.conv_states[i] for part in parts])
            joint.is_conv_states_initialized[i] = True
        if first.is_recurrent_states_initialized[i]:
            joint.recurrent_states[i] = torch.cat([part.recurrent_states[i] for part in parts])
            joint.is_recurrent_states_initialized[i] = True
    return Cache(layers=[placeholder_cache_layer() for _ in range(layer)] + [joint])


def unstack_layer_states(joint: Cache, caches: list[Cache], layer: int) -> None:
    """Copy the stacked states of `layer` (after the batched step) back into each sequence's own Cache."""
    stacked = joint.layers[layer]
    for b, cache in enumerate(caches):
        part = cache.layers[layer]
        for i in range(part.number_of_states):
            if part.is_conv_states_initialized[i]:
                part.conv_states[i].copy_(stacked.conv_states[i][b : b + 1])
            if part.is_recurrent_states_initialized[i]:
                part.recurrent_states[i].copy_(stacked.recurrent_states[i][b : b + 1])
