"""The engine's paged KV memory and the per-step plan that the packed forward reads it by.

One forward of the engine runs the new tokens of many requests packed into a single row [1, T]. Each layer's
keys and values live side by side in storage [num_blocks * block_size, H_kv, d_k + d_v]; slot = block *
block_size + offset. The step's `StepPlan` says where each packed token is written (slot_mapping [T]) and, per
request, which query tokens it has and which slots hold its context. `update()` writes, then hands the attention
function (attention.py) the storage with the plan attached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache.block_pool import BlockPool


@dataclass
class StepPlan:
    slot_mapping: torch.Tensor  # [T] long: where each packed token's K/V is written
    # single-token queries (decodes), batched in groups of similar context length (less padding to gather):
    # (their token indices in the packed row [g], context slots [g, Lmax] padded with slot 0, lengths [g])
    decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # multi-token queries (prefill chunks): (first packed index, count, context slots [ctx]) per request
    chunks: list[tuple[int, int, torch.Tensor]]


class EngineLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, kv: EngineKV, layer_idx: int):
        super().__init__()
        self.kv, self.layer_idx = kv, layer_idx
        self.storage: torch.Tensor | None = None

    def lazy_initialization(self, key_states, value_states):  # storage is made on the first write
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states [1, H_kv, T, d_k], value_states [1, H_kv, T, d_v] -> handles (views of storage + plan)."""
        plan = self.kv.plan
        if self.storage is None:
            heads, dk, dv = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
            self.storage = key_states.new_empty((self.kv.num_slots, heads, dk + dv))
            self.storage[: self.kv.block_size] = 0  # the null block: decode padding reads it (masked, must be finite)
        dk = key_states.shape[-1]
        both = torch.cat([key_states[0], value_states[0]], dim=-1).transpose(0, 1)  # [T, H_kv, d_k + d_v]
        self.storage.index_copy_(0, plan.slot_mapping, both.to(self.storage.dtype))
        handles = []
        for part in (slice(None, dk), slice(dk, None)):
            handle = self.storage[:, :, part]
            handle.engine_plan, handle.engine_storage, handle.engine_key_dim = plan, self.storage, dk
            handles.append(handle)
        return tuple(handles)

    def get_seq_length(self) -> int:
        return 0  # positions come from the engine's position_ids; masks from the plan

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass


class EngineKV(Cache):
    """Block storage for all layers plus the block pool (allocation, reference counts, prefix hashes)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.num_slots = num_blocks * block_size
        self.pool = BlockPool(num_blocks)
        self.plan: StepPlan | None = None
        super().__init__(layers=[EngineLayer(self, i) for i in range(num_layers)])

    def slots(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        """Slots of positions [start, stop) of a request whose block table is `table`."""
        positions = torch.arange(start, stop)
        blocks = torch.tensor(table, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size
