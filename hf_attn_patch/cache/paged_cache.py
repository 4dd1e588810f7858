"""PagedKVCache: a transformers `Cache` whose KV lives in fixed-size blocks allocated as tokens arrive.

Layout. Each attention layer owns one KVStorage (kv_storage.py: head-major keys [H, slots, d_k] and values
[H, slots, d_v], or both fused in one row per token where the layer's CacheSpec says so). All layers of a *group* (full
attention, or one sliding window size) share one block table per row and one BlockPool: the k-th block of a row's
table holds its positions [k*bs, (k+1)*bs) in every layer of the group.

Rows. Every row has the same logical length L (as generate() keeps it). A row's first `pad` positions are left
padding: they map to the null block (zero keys, masked anyway) and take no memory. Sliding-window groups free the
blocks no future query can see and point their entries at the null block too.

Sharing. Beam reordering, num_return_sequences forks and prefix hits share blocks by reference count; the first
write into a shared, partly filled block copies it first (copy-on-write). Full prompt blocks are named by a hash
chain (prefix_cache.py); a later request whose prompt starts with them reuses them and skips their prefill.
All of that bookkeeping is the KV manager's (manager.py): this class is the transformers `Cache` adapter over it,
owning only the storage tensors and the slot tables built from the manager's block tables.

Reads. The step's write and read slots per group (slot_plan.py): strided views of the storage when the rows are
consecutive runs at one stride (one unpadded row, or a batch laid out by `start_request(max_length=...)`, which
generate() passes), else whole pages per head or slot by slot.
The returned K/V are [B, H, L, d] as DynamicCache returns them, so every attention implementation and both MLA
paths work unchanged. Under the registered "paged_kv" attention, a decode step on CUDA instead returns flat views
of the layer's storage (the kernels' [slots, H, d] pages) and puts the storage in a forward context with the step's
AttentionMetadata (block tables in stored positions, left padding excluded, built once at the first layer), so the
decode kernels read the pages by block.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from ..kv_memory import layer_caches
from .block_pool import NULL_BLOCK
from . import metadata
from .kv_storage import KVStorage, apply_copies
from .manager import STATE, KVManager
from .paged_layer import PagedLayer
from .metadata import PAGED_ATTENTION, ForwardContext, build_metadata, get_forward_context, set_forward_context
from .slot_plan import SlotPlan

logger = logging.getLogger(__name__)

_PAGED_TYPES = ("full_attention", "sliding_attention")
_PASS_THROUGH_TYPES = ("linear_attention", "conv", "dummy")  # constant-size state: transformers' own layers
_GROWABLE_START_BLOCKS = 64


@dataclass
class _Row:
    """One sequence: its id in the KV manager, left padding and prompt tokens (for prefix hashing).

    Positions [0, pad) are not stored: the left padding, or for a laid-out row only its whole blocks of padding (the
    rest of its first block is stored, masked like any padding; such a row names no blocks for prefix hits, since
    their content would not be its prompt's alone)."""

    id: int
    pad: int = 0
    tokens: list[int] = field(default_factory=list)


class PagedKVCache(Cache):
    """Paged KV cache for `generate()`: blocks on demand, prefix caching, copy-on-write.

    Args:
        config: the model config (layer kinds and sizes are read from it).
        block_size: tokens per block.
        num_blocks: pool size in blocks (block 0 is reserved as the null block). With neither this nor
            `max_memory`, the pool starts small and doubles when it runs out.
        max_memory: pool size in bytes of KV storage (all layers); exclusive with `num_blocks`.
        enable_prefix_caching: reuse full prompt blocks across requests sharing this object (full-attention models
            only: sliding windows and SSM states have no block-wise prefix).
    """

    def __init__(
        self,
        config,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | None = None,
        enable_prefix_caching: bool = True,
    ):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive integer")
        if num_blocks is not None and max_memory is not None:
            raise ValueError(f"give num_blocks={num_blocks!r} or max_memory={max_memory!r}, not both")
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 2):
            raise ValueError(f"num_blocks={num_blocks!r} must be an integer >= 2 (block 0 is the null block)")
        if max_memory is not None and (not isinstance(max_memory, int) or max_memory < 1):
            raise ValueError(f"max_memory={max_memory!r} must be a positive number of bytes")
        config = config.get_text_config(decoder=True)
        self.config = config  # its _attn_implementation is read at every update (it may change after construction)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        caches = layer_caches(config)
        self.values_per_token = [c.values_per_token for c in caches]
        self.specs = [c.spec for c in caches]  # per layer what it caches: the storage's layout
        layers = []
        self._pass_through = {}  # layer index -> (type, kwargs): rebuilt fresh for every new request
        for idx, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if kind in _PAGED_TYPES:
                layers.append(PagedLayer(self, idx, kwargs.get("sliding_window")))
            elif kind in _PASS_THROUGH_TYPES:
                self._pass_through[idx] = (kind, kwargs)
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
            else:
                raise ValueError(f"layer type {kind!r} (layer {idx}) is not supported by PagedKVCache")
        super().__init__(layers=layers)
        self.block_size, self.max_memory = block_size, max_memory
        self.paged = [layer for layer in layers if isinstance(layer, PagedLayer)]
        self.groups = sorted({layer.window for layer in self.paged}, key=lambda w: (w is not None, w or 0))
        # values per token of each group's layers together: a group's block holds bs tokens of all its layers
        self.group_values = {
            g: sum(self.values_per_token[l.layer_idx] for l in self.paged if l.window == g) for g in self.groups
        }
        self.prefix_caching = enable_prefix_caching and self.groups == [None] and len(self.paged) == len(layers)
        if enable_prefix_caching and not self.prefix_caching:
            logger.info("prefix caching disabled: it needs full attention in every layer (no windows, no SSM)")
        self.num_blocks = num_blocks
        self.manager: KVManager | None = None  # created at the first update (max_memory needs the dtype)
        self.growable = num_blocks is None and max_memory is None
        self._ids = itertools.count()
        self.rows: list[_Row] = []
        self.prefix_hit_tokens = 0
        self.slots = SlotPlan(block_size, self.groups)  # the step's write / read slots per group (slot_plan.py)
        self._reserve = 0  # blocks per row to lay the next request's rows out in (KVManager.reserve_runs); 0: none
        self._padding_storable = True  # a laid-out row may store its first block's padding (not under the kernels)
        self._pool_blocks: dict = {}  # group -> blocks in its pool at this step (the storage's first dimension)
        self._storage_blocks: dict = {}  # group -> blocks of its layers' storage (all grown together)
        self._unregistered = True  # some row may not be in the manager yet
        self._left_padding_only = True  # the prompt mask is left padding then ones (see start_request)
        self._kernel_step = False  # this step's attention reads the pages by block table (paged_kv decode on CUDA)
        self._step_start = 0  # first logical position written by the step in flight

    # -- requests --------------------------------------------------------------------------------------------

    def start_request(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_length: int | None = None
    ) -> int:
        """Begin a new batch of prompts: release the previous rows, learn each row's left padding, and attach the
        cached blocks of the longest prefix all rows can skip. Returns the number of positions skipped.

        max_length (prompt + new tokens; generate() passes its own): rows without a prefix hit get side-by-side runs
        of that many positions, so every step reads them as one view of the storage. A row whose left padding ends
        inside a block then stores that block's padding; unless the block-table kernels run (they need the padding
        unstored), in which case such a batch is not laid out."""
        if attention_mask is not None and input_ids.shape[1] < attention_mask.shape[1]:
            return 0  # only the new tokens of a continuing request were passed: keep the rows as they are
        if max_length is not None and (not isinstance(max_length, int) or max_length < input_ids.shape[1]):
            raise ValueError(f"max_length={max_length!r} must be an integer >= the prompt length {input_ids.shape[1]}")
        self._release_rows()
        for idx, (kind, kwargs) in self._pass_through.items():  # constant-size states start over
            self.layers[idx] = DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        started = mask.cumsum(1) > 0  # from each row's first real token on
        pads = (~started).sum(1).tolist()  # leading zeros = left padding
        # The block-table kernels see each row as its stored positions, all visible: a mask with a hole after the
        # first real token (not plain left padding) must go through the masked reference instead.
        self._left_padding_only = bool(started.le(mask.bool()).all())
        self.rows = [_Row(next(self._ids), pad, input_ids[r, pad:].tolist()) for r, pad in enumerate(pads)]
        self._unregistered = True
        skip = self._attach_prefix() if self.prefix_caching and self.manager is not None else 0
        for row in self.rows:
            if self.manager is not None and row.id not in self.manager.sequences:
                self.manager.add(row.id)
        for layer in self.paged:
            layer.length = skip
        self._reserve = -(-max_length // self.block_size) if max_length is not None and not skip else 0
        self._padding_storable = not metadata.use_kernels(input_ids)
        return skip

    def _attach_prefix(self) -> int:
        """Attach cached blocks for the first `skip` logical positions of every row (the same for all rows; a
        partly used block is shared and copied on the first write)."""
        hits = [self.manager.cached_prefix_blocks(row.tokens) for row in self.rows]
        skip = min(row.pad + len(h) * self.block_size for row, h in zip(self.rows, hits))
        for row, h in zip(self.rows, hits):
            self.manager.add(row.id)
            self.prefix_hit_tokens += self.manager.attach_prefix(row.id, h, max(0, skip - row.pad))
        return skip

    def _release_rows(self) -> None:
        for row in self.rows:
            if self.manager is not None:
                self.manager.free(row.id)
        self.rows = []
        self.slots.forget()

    # -- the step: allocation on the first paged layer, write + gather on every layer ------------------------

    def _layer_update(self, layer: PagedLayer, keys: torch.Tensor, values: torch.Tensor):
        """keys [B, H_k, T, d_k], values [B, H_v, T, d_v] -> all of this layer's [B, H, L + T, d].

        The step's bookkeeping (blocks, slots, whether kernels read the pages) is done once, at the first paged
        layer; every layer then only writes its new K/V and reads its context (a decode step of a model with
        a few small layers is a handful of tensor ops each, so the per-layer Python is kept to the minimum)."""
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        if layer is self.paged[0]:
            self._begin_step(keys)
        storage, window, start = layer.storage, layer.window, layer.length
        if storage is None or storage.num_blocks < self._pool_blocks[window]:
            storage = self._grow_storage(layer, keys, values)
        length = layer.length = start + keys.shape[2]
        views = self.slots.store(storage, window, start, keys, values)
        if layer is self.paged[-1]:
            self._end_step()
        if self._kernel_step:
            if layer is self.paged[0]:
                set_forward_context(self._decode_context(keys.device))
            get_forward_context().storage[layer.layer_idx] = storage
            return storage.key_cache, storage.value_cache  # the pages themselves: the backend reads them by block table
        return views if views is not None else self._read_layer(layer, length)

    def _read_layer(self, layer: PagedLayer, length: int):
        """K [B, H, L, d_k], V [B, H, L, d_v] of a paged layer's first `length` positions."""
        return self.slots.gather(layer.storage, layer.window, len(self.rows), length)

    def _decode_context(self, device) -> ForwardContext:
        """The decode step's metadata (one new token per row, stored coordinates) for the paged backend."""
        tables = [{g: self.manager.table(row.id, g) for g in self.groups} for row in self.rows]
        starts = [self.paged[0].length - 1 - row.pad for row in self.rows]
        kinds = [layer.window if isinstance(layer, PagedLayer) else STATE for layer in self.layers]
        meta = build_metadata(tables, starts, [1] * len(self.rows), self.block_size, kinds, device)
        return ForwardContext(
            meta,
            [None] * len(self.layers),
            {g: p.num_blocks for g, p in self.manager.pools.items()},
            route=False,
            gather=self._gather,
            last_layer=self.paged[-1].layer_idx,
            specs=self.specs,
        )

    def _gather(self, layer_idx: int):
        """K [B, H, L, d_k], V [B, H, L, d_v] of one paged layer (the reference path of a paged_kv decode)."""
        layer = self.layers[layer_idx]
        return self._read_layer(layer, layer.length)

    def _begin_step(self, keys: torch.Tensor) -> None:
        """Give every row blocks for the new positions of keys [B, H, T, d] (copying shared partly filled ones),
        build the step's slots, and decide whether this step's attention reads the pages by block table."""
        batch, new, device = keys.shape[0], keys.shape[2], keys.device
        if self.manager is None:
            self._create_manager(keys.element_size())
        if len(self.rows) != batch:
            if self.rows:
                raise ValueError(f"the cache holds {len(self.rows)} rows but the model was called with batch {batch}")
            self.rows = [_Row(next(self._ids)) for _ in range(batch)]
            self._unregistered = True
        if self._unregistered:
            for row in self.rows:
                if row.id not in self.manager.sequences:
                    self.manager.add(row.id)
            self._unregistered = False
        start = self.paged[0].length
        if new == 1 and self.slots.steady(start, self.rows, self.manager.version):
            self.slots.advance(start)
        else:
            self._plan_step(start, new, device)
        self._kernel_step = (
            new == 1
            and self._left_padding_only
            and metadata.use_kernels(keys)
            and self.config._attn_implementation == PAGED_ATTENTION
        )
        self._step_start = start

    def _plan_step(self, start: int, new: int, device) -> None:
        """Blocks for the step's positions (copying shared partly filled ones, freeing out-of-window ones) and the
        slots every layer writes and reads."""
        self.slots.steady_from = -1  # also when the allocation below raises CacheFullError
        if self._reserve:  # the request's first step: lay its rows out side by side
            self.slots.lay_out(self.rows, self.manager, self._reserve, self._padding_storable)
            self._reserve = 0
        # stored positions (left padding excluded) written this step; all rows or none (CacheFullError)
        self.manager.allocate_many(
            [(row.id, max(0, start - row.pad), max(0, start + new - row.pad)) for row in self.rows]
        )
        self._pool_blocks = {g: pool.num_blocks for g, pool in self.manager.pools.items()}
        if self._pool_blocks != self._storage_blocks:  # the pools grew: storage first, so copies have their targets
            for layer in self.paged:
                if layer.storage is not None and layer.storage.num_blocks < self._pool_blocks[layer.window]:
                    self._grow_storage(layer, None, None)
            self._storage_blocks = dict(self._pool_blocks)  # layers without storage yet make it at this size
        apply_copies(self.manager.take_copies(), [(layer.window, layer.storage) for layer in self.paged])
        for group in self.groups:
            if group is not None:
                for row in self.rows:
                    self.manager.free_out_of_window(row.id, max(0, start - row.pad))
                break  # free_out_of_window serves every window group at once
        self.slots.plan(self.rows, self.manager, start, new, device)

    def _end_step(self) -> None:
        """Name the prompt blocks that just became full, so later requests can reuse them (only a step that
        wrote prompt positions can fill one: decoded tokens are not part of any prompt)."""
        length = self.paged[0].length
        for row in self.rows:
            if self._step_start - row.pad < len(row.tokens):
                self.manager.commit(row.id, row.tokens[: max(0, length - row.pad)])

    # -- pool and storage ------------------------------------------------------------------------------------

    def bytes_per_block(self, group, element_size: int) -> int:
        """Bytes one block of `group` takes: block_size tokens of every layer in the group."""
        return self.group_values[group] * self.block_size * element_size

    def _create_manager(self, element_size: int) -> None:
        """The KV manager with pools from num_blocks (each group) or max_memory (split by each group's bytes per
        token); without either, small pools that double when they run out."""
        sizes = {}
        for group in self.groups:
            if self.max_memory is not None:
                share = self.group_values[group] / sum(self.group_values.values())
                blocks = int(self.max_memory * share) // self.bytes_per_block(group, element_size)
                if blocks < 2:
                    raise ValueError(
                        f"max_memory={self.max_memory} gives {blocks} block(s) of "
                        f"{self.bytes_per_block(group, element_size)} bytes: "
                        "at least 2 are needed (one is the null block)"
                    )
            else:
                blocks = self.num_blocks or _GROWABLE_START_BLOCKS
            sizes[group] = blocks
        self.manager = KVManager(self.block_size, sizes, self.groups, self.prefix_caching, growable=self.growable)

    def _grow_storage(self, layer: PagedLayer, keys, values) -> KVStorage:
        """Allocate (first call) or extend this layer's storage to pool.num_blocks blocks; new blocks are zero."""
        num_blocks = self.manager.pools[layer.window].num_blocks
        if layer.storage is None:
            if keys.shape[1] != values.shape[1]:
                raise ValueError(f"keys have {keys.shape[1]} heads and values {values.shape[1]}: they must match")
            layer.storage = KVStorage(
                num_blocks,
                self.block_size,
                keys.shape[1],
                keys.shape[-1],
                values.shape[-1],
                keys,
                fused=self.specs[layer.layer_idx].fused,
            )
        else:
            layer.storage.grow(num_blocks)
        self.slots.gather_index.clear()  # the flat indices depend on the storage's size
        return layer.storage

    # -- transformers' Cache API over rows -------------------------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: new row i continues old row beam_idx[i]. Tables are rewritten; no KV is copied."""
        self._remap_rows(beam_idx.tolist())
        for layer in self._pass_through_layers():
            layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` rows sharing its blocks (num_return_sequences, beams after prefill)."""
        self._remap_rows([i for i in range(len(self.rows)) for _ in range(repeats)])
        for layer in self._pass_through_layers():
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap_rows(indices.tolist())
        for layer in self._pass_through_layers():
            layer.batch_select_indices(indices)

    def _remap_rows(self, sources: list[int]) -> None:
        """New row i continues old row sources[i], sharing its blocks by reference count (nothing is copied)."""
        self.slots.forget()
        self._unregistered = True
        old, self.rows = self.rows, []
        for i in sources:
            row = _Row(next(self._ids), old[i].pad, old[i].tokens)
            if self.manager is not None:
                self.manager.fork(old[i].id, row.id)
            self.rows.append(row)
        for row in old:
            if self.manager is not None:
                self.manager.free(row.id)

    def _pass_through_layers(self) -> list:
        return [layer for layer in self.layers if not isinstance(layer, PagedLayer)]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove positions (transformers' convention: a non-positive count; assisted
        decoding rolls back rejected draft tokens with it). Whole blocks past the new end are freed."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove")
        keep = max(0, self.get_seq_length() + tokens_to_remove)
        self.slots.forget()
        for row in self.rows:
            if self.manager is not None:
                self.manager.crop(row.id, max(0, keep - row.pad))
        for layer in self.paged:
            layer.length = keep
        for layer in self._pass_through_layers():
            layer.crop(tokens_to_remove)

    def reset(self) -> None:
        self._release_rows()
        super().reset()

    # -- accounting ------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Memory and prefix-cache figures for the KV storage of the paged layers.

        allocated_bytes: blocks referenced by live rows; used_bytes: the token slots of those blocks that hold
        tokens (a block shared by several rows counts once); utilization = used / allocated.
        """
        layer = self.paged[0] if self.paged else None
        element_size = layer.storage.element_size if layer is not None and layer.storage is not None else 0
        allocated = used = 0
        for group in self.groups:
            filled = {}  # block -> slots holding tokens
            for row in self.rows if self.manager is not None else []:
                stored = max(0, layer.length - row.pad)
                for k, block in enumerate(self.manager.table(row.id, group)):
                    if block != NULL_BLOCK:
                        filled[block] = max(filled.get(block, 0), min(self.block_size, stored - k * self.block_size))
            per_slot = self.group_values[group] * element_size
            allocated += len(filled) * self.block_size * per_slot
            used += sum(filled.values()) * per_slot
        blocks = (
            self.manager.block_stats()
            if self.manager is not None
            else {
                "block_size": self.block_size,
                "blocks_total": 0,
                "blocks_used": 0,
                "blocks_cached": 0,
                "blocks_free": 0,
            }
        )
        return {
            "allocated_bytes": allocated,
            "used_bytes": used,
            "utilization": used / allocated if allocated else 1.0,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            **blocks,
        }
