"""PagedKVCache: a transformers `Cache` whose KV lives in fixed-size blocks allocated as tokens arrive.

Layout. Each attention layer owns one KVStorage (kv_storage.py: head-major keys [H, slots, d_k] and values
[H, slots, d_v]; MLA layers: H = 1, the latent and the RoPE key fused in one tensor). All layers of a *group* (full
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

Reads. Rows whose blocks are consecutive runs at one stride, each run starting with the row's whole blocks of left
padding (one unpadded row, or a batch laid out by `start_request(max_length=...)`, which generate() passes), are
written and read as strided views of the storage, with no copy; otherwise a step gathers whole pages per head (rows
whose left padding is whole blocks) or slot by slot (the rest, whose pages do not start at the same position).
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
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..kv_memory import layer_caches
from .block_pool import NULL_BLOCK
from .kv_storage import KVStorage
from .manager import KVManager
from . import metadata
from .manager import STATE
from .metadata import PAGED_ATTENTION, ForwardContext, build_metadata, get_forward_context, set_forward_context

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


class PagedLayer(CacheLayerMixin):
    """A view of one attention layer inside a PagedKVCache; the cache does the work."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: "PagedKVCache", layer_idx: int, window: int | None):
        super().__init__()
        self.cache, self.layer_idx, self.window = cache, layer_idx, window
        self.is_sliding = window is not None
        self.length = 0  # tokens this layer has seen (logical, padding included)
        self.storage: KVStorage | None = None  # made at the first write (GQA: H = H_kv; MLA: H = 1, fused)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache._layer_update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0


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

    def __init__(self, config, block_size: int = 16, num_blocks: int | None = None, max_memory: int | None = None,
                 enable_prefix_caching: bool = True):  # fmt: skip
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
        self.values_per_token = [c.values_per_token for c in layer_caches(config)]
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
        self.group_values = {g: sum(self.values_per_token[l.layer_idx] for l in self.paged if l.window == g)
                             for g in self.groups}  # fmt: skip
        self.prefix_caching = enable_prefix_caching and self.groups == [None] and len(self.paged) == len(layers)
        if enable_prefix_caching and not self.prefix_caching:
            logger.info("prefix caching disabled: it needs full attention in every layer (no windows, no SSM)")
        self.num_blocks = num_blocks
        self.manager: KVManager | None = None  # created at the first update (max_memory needs the dtype)
        self.growable = num_blocks is None and max_memory is None
        self._ids = itertools.count()
        self.rows: list[_Row] = []
        self._version = -1  # the manager's version the kept read slots were built against
        self.prefix_hit_tokens = 0
        # group -> slot ids of the step in flight: write [B, T], read [B, L] (kept and extended between steps)
        self._write: dict = {}
        self._write_all_valid: dict = {}
        self._write_flat: dict = {}  # group -> the write slots flattened [B * T]
        self._read: dict = {}
        self._read_len: dict = {}  # group -> positions whose read slots are valid in self._read[group]
        self._read_index: dict = {}  # group -> this step's read slots [B, L] flattened to [B * L]
        self._pages: dict = {}  # group -> [B, n] blocks of each row's logical positions (rows aligned to blocks)
        self._gather_index: dict = {}  # (group, heads, num_blocks, kind) -> the storage gather index of this step
        self._strided: dict = {}  # group -> (first slot, row stride) when the rows are read as a view, else None
        self._reserve = 0  # blocks per row to lay the next request's rows out in (KVManager.reserve_runs); 0: none
        self._padding_storable = True  # a laid-out row may store its first block's padding (not under the kernels)
        self._pool_blocks: dict = {}  # group -> blocks in its pool at this step (the storage's first dimension)
        self._storage_blocks: dict = {}  # group -> blocks of its layers' storage (all grown together)
        self._unregistered = True  # some row may not be in the manager yet
        self._left_padding_only = True  # the prompt mask is left padding then ones (see start_request)
        self._kernel_step = False  # this step's attention reads the pages by block table (paged_kv decode on CUDA)
        self._step_start = 0  # first logical position written by the step in flight
        self._steady_from = -1  # the position the last decode step wrote, when the next may reuse its slots

    # -- requests --------------------------------------------------------------------------------------------

    def start_request(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      max_length: int | None = None) -> int:  # fmt: skip
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
        self._forget_slots()

    def _forget_slots(self) -> None:
        """The rows or their tables changed: the kept read slots are rebuilt at the next step."""
        self._read.clear()
        self._steady_from = -1

    def _table(self, row: _Row, group) -> list[int]:
        return self.manager.table(row.id, group)

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
        layout, all_valid, views = self._strided[window], self._write_all_valid[window], None
        if layout is not None and all_valid:  # rows in consecutive slots at one stride: views in and out
            views = storage.append_strided(*layout, start, keys, values)
        elif all_valid:  # [B, H, T, d] -> [H, B * T, d] at the flat write slots
            storage.write(self._write_flat[window], keys.transpose(0, 1).flatten(1, 2),
                          values.transpose(0, 1).flatten(1, 2))  # fmt: skip
        else:  # prefill with left padding: padded positions are not stored
            valid = self._write[window].view(-1) >= 0
            storage.write(self._write_flat[window][valid], keys.transpose(0, 1).flatten(1, 2)[:, valid],
                          values.transpose(0, 1).flatten(1, 2)[:, valid])  # fmt: skip
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
        storage, window = layer.storage, layer.window
        layout = self._strided[window]
        if layout is not None:
            return storage.strided(*layout, len(self.rows), length)
        pages = self._pages.get(window)
        key = (window, storage.heads, storage.num_blocks, pages is not None)
        index = self._gather_index.get(key)
        if pages is not None:  # rows aligned to blocks: whole pages
            if index is None:
                index = self._gather_index[key] = storage.page_index(pages)
            return storage.read_pages(index, len(self.rows), length)
        if index is None:
            index = self._gather_index[key] = storage.slot_index(self._read_index[window])
        return storage.read_slots(index, len(self.rows), length)

    def _decode_context(self, device) -> ForwardContext:
        """The decode step's metadata (one new token per row, stored coordinates) for the paged backend."""
        tables = [{g: self._table(row, g) for g in self.groups} for row in self.rows]
        starts = [self.paged[0].length - 1 - row.pad for row in self.rows]
        kinds = [layer.window if isinstance(layer, PagedLayer) else STATE for layer in self.layers]
        meta = build_metadata(tables, starts, [1] * len(self.rows), self.block_size, kinds, device)
        return ForwardContext(meta, [None] * len(self.layers), {g: p.num_blocks for g, p in self.manager.pools.items()},
                              route=False, gather=self._gather, last_layer=self.paged[-1].layer_idx)  # fmt: skip

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
        if new == 1 and self._steady(start):
            self._advance_slots(start)
        else:
            self._plan_step(start, new, device)
        self._kernel_step = (new == 1 and self._left_padding_only and metadata.use_kernels(keys)
                             and self.config._attn_implementation == PAGED_ATTENTION)  # fmt: skip
        self._step_start = start

    def _steady(self, start: int) -> bool:
        """Whether this decode step changes nothing but one slot per row: the rows, tables and pools are those of the
        last step, which wrote position start - 1 of every row in the same block that position `start` falls in
        (so no block is allocated, copied or freed: the last write made that block the row's own)."""
        bs = self.block_size
        return (self._version == self.manager.version and self._steady_from == start - 1 and self.groups == [None]
                and all((start - row.pad) % bs for row in self.rows))  # fmt: skip

    def _advance_slots(self, start: int) -> None:
        """The steady decode step's slots: each row's write slot is last step's + 1 (the same block)."""
        self._steady_from = start
        if self._strided[None] is not None:
            return  # read and written through views of the storage: no slot tables
        write = self._write[None] + 1
        buffer = self._read[None]
        if buffer.shape[1] <= start:  # doubling: amortized O(1) per decoded position
            buffer = self._read[None] = torch.cat((buffer, torch.empty_like(buffer)), dim=1)
        buffer[:, start] = write[:, 0]
        self._write[None], self._write_flat[None] = write, write.view(-1)
        self._read_len[None] = start + 1
        if self._pages.get(None) is None:  # slot by slot: the read index and the gather index grow by a position
            self._read_index[None] = buffer[:, : start + 1].reshape(-1)
            self._gather_index.clear()

    def _plan_step(self, start: int, new: int, device) -> None:
        """Blocks for the step's positions (copying shared partly filled ones, freeing out-of-window ones) and the
        slots every layer writes and reads."""
        self._steady_from = -1
        if self._reserve:  # the request's first step: lay its rows out side by side
            self._lay_out_rows()
        # stored positions (left padding excluded) written this step; all rows or none (CacheFullError)
        self.manager.allocate_many([(row.id, max(0, start - row.pad), max(0, start + new - row.pad))
                                    for row in self.rows])  # fmt: skip
        self._pool_blocks = {g: pool.num_blocks for g, pool in self.manager.pools.items()}
        if self._pool_blocks != self._storage_blocks:  # the pools grew: storage first, so copies have their targets
            for layer in self.paged:
                if layer.storage is not None and layer.storage.num_blocks < self._pool_blocks[layer.window]:
                    self._grow_storage(layer, None, None)
            self._storage_blocks = dict(self._pool_blocks)  # layers without storage yet make it at this size
        for group, source, target in self.manager.take_copies():
            for layer in self.paged:
                if layer.window == group and layer.storage is not None:
                    layer.storage.copy_block(source, target)
        for group in self.groups:
            if group is not None:
                for row in self.rows:
                    self.manager.free_out_of_window(row.id, max(0, start - row.pad))
                break  # free_out_of_window serves every window group at once
        if self._version != self.manager.version:  # tables changed under the kept read slots
            self._forget_slots()
            self._version = self.manager.version
        for group in self.groups:
            self._update_slots(group, start, new, device)
        if new == 1 and self._write_all_valid.get(None, False):
            self._steady_from = start  # the next decode step may take the steady path

    def _lay_out_rows(self) -> None:
        """Runs of self._reserve blocks side by side for the new request's rows (before anything is stored), each
        run starting with the row's whole blocks of padding; a row whose padding ends inside a block then stores
        that block's padding too, so that its positions start at a block boundary of its run."""
        bs, rows, blocks, self._reserve = self.block_size, self.rows, self._reserve, 0
        if any(row.pad % bs for row in rows) and not self._padding_storable:
            return  # the block-table kernels read every stored position as visible
        if self.manager.reserve_runs([row.id for row in rows], blocks, [row.pad // bs for row in rows]):
            for row in rows:
                if row.pad % bs:
                    row.pad, row.tokens = row.pad - row.pad % bs, []

    def _update_slots(self, group, start: int, new: int, device) -> None:
        """Slots of this step: write [B, new] (-1: padding, not stored) and read [B, start + new].

        Read slots of the cached positions are kept between steps and only extended, unless the block tables
        changed under them (a new request, beams, forks, crops, copies, window frees): then they are rebuilt.
        A slot is block * block_size + offset; slots in the null block read zeros.
        """
        self._strided[group] = layout = self._strided_layout(group, start + new)
        if layout is not None:  # written and read through views of the storage: no read slots
            # a row's padding inside its first block is written slot by slot (the view would write its
            # unstored leading positions too)
            self._write_all_valid[group] = all(start >= row.pad for row in self.rows)
            if not self._write_all_valid[group]:
                write = self._slots(group, start, start + new).to(device)
                self._write[group], self._write_flat[group] = write, write.view(-1)
            self._read.pop(group, None)  # rebuilt from the tables if the layout ever breaks
            self._read_len.pop(group, None)
            self._pages[group] = None
            return
        rows, end = self.rows, start + new
        buffer = self._read.get(group)  # [B, capacity]: slots of positions [0, self._read_len[group]) are valid
        rebuilt = buffer is None or buffer.shape[0] != len(rows) or self._read_len.get(group) != start
        if rebuilt:
            buffer = torch.empty((len(rows), max(2 * end, 64)), dtype=torch.long, device=device)
            buffer[:, :start] = self._slots(group, 0, start).clamp(min=0)
        elif buffer.shape[1] < end:  # doubling: amortized O(1) per decoded position
            buffer = torch.cat((buffer, torch.empty_like(buffer)), dim=1)
        write = self._slots(group, start, end).to(device)
        self._write[group], self._write_flat[group] = write, write.view(-1)
        if new == 1:  # a decode step: a row writes a padding position only if it is all padding so far
            self._write_all_valid[group] = all(start >= row.pad for row in rows)
        else:
            self._write_all_valid[group] = bool((write >= 0).all())
        buffer[:, start:end] = write if self._write_all_valid[group] else write.clamp(min=0)
        self._read[group], self._read_len[group] = buffer, end
        read = buffer[:, :end]
        self._read_index[group] = read.reshape(-1)  # one flat index for every layer of the group this step
        self._gather_index = {key: index for key, index in self._gather_index.items() if key[0] != group}
        self._pages[group] = None
        if all(row.pad % self.block_size == 0 for row in rows):  # every row's pages start at a logical block
            self._pages[group] = self._page_table(group, end, device)

    def _strided_layout(self, group, end: int) -> tuple[int, int] | None:
        """(first slot, row stride in slots) when row r's logical positions [0, end) are the consecutive slots from
        first + r * stride: its stored blocks consecutive, its whole blocks of left padding just before them (read,
        never written: masked, and unused by anyone else while the rows are laid out). One row alone, or rows laid
        out by reserve_runs; the rows are then read as one view of the storage. None otherwise."""
        bs, n, starts = self.block_size, -(-end // self.block_size), []
        for row in self.rows:
            lead = row.pad // bs
            table = self._table(row, group)[: n - lead]
            if row.pad % bs or not table or table[0] < lead or table != list(range(table[0], table[0] + n - lead)):
                return None
            starts.append(table[0] - lead)
        stride = starts[1] - starts[0] if len(starts) > 1 else 0
        if stride < 0 or any(v != starts[0] + r * stride for r, v in enumerate(starts)):
            return None
        return starts[0] * bs, stride * bs

    def _page_table(self, group, end: int, device) -> torch.Tensor:
        """[B, n] blocks holding logical positions [k * bs, (k + 1) * bs) of each row (n * bs >= end; left padding
        and positions past a row's table read the null block). Rows' padding must be whole blocks."""
        bs = self.block_size
        width = -(-end // bs)
        pages = []
        for row in self.rows:
            table = [NULL_BLOCK] * (row.pad // bs) + self._table(row, group)
            pages.append(table[:width] + [NULL_BLOCK] * (width - len(table)))
        return torch.tensor(pages, dtype=torch.long, device=device)

    def _slots(self, group, start: int, end: int) -> torch.Tensor:
        """[B, end - start] slot ids of positions [start, end) of every row; -1 for left padding."""
        bs = self.block_size
        if end - start == 1:  # a decode step: plain integer arithmetic beats a dozen tiny tensor ops
            slots = []
            for row in self.rows:
                stored = start - row.pad
                slots.append([self._table(row, group)[stored // bs] * bs + stored % bs if stored >= 0 else -1])
            return torch.tensor(slots, dtype=torch.long)
        positions = torch.arange(start, end)
        out = []
        for row in self.rows:
            table = torch.tensor(self._table(row, group) or [NULL_BLOCK], dtype=torch.long)
            stored = positions - row.pad
            index = stored.clamp(min=0)
            slots = table[(index // bs).clamp(max=len(table) - 1)] * bs + index % bs
            out.append(torch.where(stored >= 0, slots, -1))
        return torch.stack(out) if out else torch.empty(0, end - start, dtype=torch.long)

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
                        f"{self.bytes_per_block(group, element_size)} bytes: at least 2 are needed (one is the null block)"
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
            layer.storage = KVStorage(num_blocks, self.block_size, keys.shape[1], keys.shape[-1], values.shape[-1],
                                      keys, fused=keys.shape[1] == 1)  # fmt: skip
        else:
            layer.storage.grow(num_blocks)
        self._gather_index.clear()  # the flat indices depend on the storage's size
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
        self._forget_slots()
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
        self._forget_slots()
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
                for k, block in enumerate(self._table(row, group)):
                    if block != NULL_BLOCK:
                        filled[block] = max(filled.get(block, 0), min(self.block_size, stored - k * self.block_size))
            per_slot = self.group_values[group] * element_size
            allocated += len(filled) * self.block_size * per_slot
            used += sum(filled.values()) * per_slot
        pools = list(self.manager.pools.values()) if self.manager is not None else []
        return {
            "allocated_bytes": allocated,
            "used_bytes": used,
            "utilization": used / allocated if allocated else 1.0,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "blocks_total": sum(p.num_blocks - 1 for p in pools),
            "blocks_used": sum(p.num_live() for p in pools),
            "blocks_cached": sum(p.num_cached() for p in pools),
            "blocks_free": sum(p.num_available() - p.num_cached() for p in pools),
            "block_size": self.block_size,
        }

