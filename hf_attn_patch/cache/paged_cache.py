"""PagedKVCache: a transformers `Cache` whose KV lives in fixed-size blocks allocated as tokens arrive.

Layout. Each attention layer owns one storage `[num_blocks, block_size, H, d_k + d_v]`, keys and values side by
side (MLA layers: H = 1, d_k = kv_lora_rank, d_v = qk_rope_head_dim; the latent and the RoPE key only). All layers of
a *group* (full attention, or one sliding window size) share one block table per row and one BlockPool: the k-th
block of a row's table holds its positions [k*bs, (k+1)*bs) in every layer of the group.

Rows. Every row has the same logical length L (as generate() keeps it). A row's first `pad` positions are left
padding: they map to the null block (zero keys, masked anyway) and take no memory. Sliding-window groups free the
blocks no future query can see and point their entries at the null block too.

Sharing. Beam reordering, num_return_sequences forks and prefix hits share blocks by reference count; the first
write into a shared, partly filled block copies it first (copy-on-write). Full prompt blocks are named by a hash
chain (prefix_cache.py); a later request whose prompt starts with them reuses them and skips their prefill.

Attention reads a row's blocks through a gather (the pure-torch path; one row in consecutive slots is read as a
view); the returned K/V are [B, H, L, d] as DynamicCache returns them, so every attention implementation and both
MLA paths work unchanged. Under the registered "paged_kv" attention the cache returns storage handles instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..kv_memory import layer_caches
from .block_pool import NULL_BLOCK, BlockPool
from .paged_attention import PAGED_ATTENTION, paged_handles, read_paged
from .prefix_cache import block_hashes

logger = logging.getLogger(__name__)

_PAGED_TYPES = ("full_attention", "sliding_attention")
_PASS_THROUGH_TYPES = ("linear_attention", "conv", "dummy")  # constant-size state: transformers' own layers
_GROWABLE_START_BLOCKS = 64


@dataclass
class _Row:
    """One sequence: left padding, prompt tokens (for prefix hashing) and a block table per group."""

    pad: int = 0
    tokens: list[int] = field(default_factory=list)
    tables: dict = field(default_factory=dict)  # group -> list of block ids
    hashes: list[bytes] = field(default_factory=list)  # hash chain of the prompt's full blocks
    registered: int = 0  # leading blocks already named in the pool's prefix table


class PagedLayer(CacheLayerMixin):
    """A view of one attention layer inside a PagedKVCache; the cache does the work."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: "PagedKVCache", layer_idx: int, window: int | None):
        super().__init__()
        self.cache, self.layer_idx, self.window = cache, layer_idx, window
        self.is_sliding = window is not None
        self.length = 0  # tokens this layer has seen (logical, padding included)
        # [num_blocks, block_size, H, d_k + d_v]: keys and values side by side, so one copy writes and one gather
        # reads both (GQA: H = H_kv; MLA: H = 1, d_k = kv_lora_rank, d_v = qk_rope_head_dim)
        self.storage: torch.Tensor | None = None
        self.key_dim = 0

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
        self.pools: dict = {}  # group -> BlockPool, created at the first update (max_memory needs the dtype)
        self.growable = num_blocks is None and max_memory is None
        self.rows: list[_Row] = []
        self.prefix_hit_tokens = 0
        # group -> slot ids of the step in flight: write [B, T], read [B, L] (kept and extended between steps)
        self._write: dict = {}
        self._write_all_valid: dict = {}
        self._read: dict = {}
        self._contiguous_from: dict = {}  # group -> first slot when the one row's slots are consecutive, else None

    # -- requests --------------------------------------------------------------------------------------------

    def start_request(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Begin a new batch of prompts: release the previous rows, learn each row's left padding, and attach the
        cached blocks of the longest prefix all rows can skip. Returns the number of positions skipped."""
        if attention_mask is not None and input_ids.shape[1] < attention_mask.shape[1]:
            return 0  # only the new tokens of a continuing request were passed: keep the rows as they are
        self._release_rows()
        for idx, (kind, kwargs) in self._pass_through.items():  # constant-size states start over
            self.layers[idx] = DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        pads = (mask.cumsum(1) == 0).sum(1).tolist()  # leading zeros = left padding
        self.rows = []
        for r, pad in enumerate(pads):
            tokens = input_ids[r, pad:].tolist()
            row = _Row(pad=pad, tokens=tokens, tables={g: [] for g in self.groups})
            if self.prefix_caching:
                row.hashes = block_hashes(tokens, self.block_size)
            self.rows.append(row)
        skip = self._attach_prefix() if self.prefix_caching and self.pools else 0
        for layer in self.paged:
            layer.length = skip
        return skip

    def _attach_prefix(self) -> int:
        """Attach cached blocks for the first `skip` logical positions of every row (same for all rows)."""
        pool = self.pools[None]
        hits = []
        for row in self.rows:
            usable = (len(row.tokens) - 1) // self.block_size  # keep >= 1 token to compute: generate needs logits
            n = 0
            while n < min(usable, len(row.hashes)) and pool.lookup(row.hashes[n]) is not None:
                n += 1
            hits.append(n)
        skip = min(row.pad + n * self.block_size for row, n in zip(self.rows, hits))
        for row in self.rows:
            stored = max(0, skip - row.pad)
            for k in range(-(-stored // self.block_size)):  # ceil: a partly used block is shared, copied on write
                block = pool.lookup(row.hashes[k])
                pool.incref(block)
                row.tables[None].append(block)
            self.prefix_hit_tokens += stored
        return skip

    def _release_rows(self) -> None:
        for row in self.rows:
            self._drop(row)
        self.rows = []
        self._read.clear()

    # -- the step: allocation on the first paged layer, write + gather on every layer ------------------------

    def _layer_update(self, layer: PagedLayer, keys: torch.Tensor, values: torch.Tensor):
        """keys [B, H_k, T, d_k], values [B, H_v, T, d_v] -> all of this layer's [B, H, L + T, d]."""
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        if layer is self.paged[0]:
            self._begin_step(keys.shape[0], keys.shape[2], keys.element_size(), keys.device)
        if layer.storage is None or layer.storage.shape[0] < self.pools[layer.window].num_blocks:
            self._grow_storage(layer, keys, values)
        window, dk = layer.window, layer.key_dim
        flat = layer.storage.view(-1, *layer.storage.shape[2:])  # [slots, H, d_k + d_v]
        first, start, length = self._contiguous_from[window], layer.length, layer.length + keys.shape[2]
        layer.length = length
        read = self._read.get(window)  # None while one contiguous row is read as a view
        if first is not None:  # one row in consecutive slots: write a slice
            flat[first + start : first + length, :, :dk] = keys[0].transpose(0, 1)
            flat[first + start : first + length, :, dk:] = values[0].transpose(0, 1)
        else:
            write = self._write[window]
            new = torch.cat((keys, values), dim=-1).transpose(1, 2)  # [B, T, H, d_k + d_v]
            if self._write_all_valid[window]:
                flat.index_copy_(0, write.view(-1), new.reshape(-1, *new.shape[2:]))
            else:  # prefill with left padding: padded positions are not stored
                valid = write >= 0
                flat[write[valid]] = new[valid]
        if layer is self.paged[-1]:
            self._end_step()
        if self.config._attn_implementation == PAGED_ATTENTION:
            return paged_handles(flat, dk, read, first, length)  # the registered attention function reads blocks
        return read_paged(flat, dk, read, first, length)

    def _begin_step(self, batch: int, new: int, element_size: int, device) -> None:
        """Give every row blocks for `new` more positions (copying shared partly filled ones) and build slots."""
        if not self.pools:
            self._create_pools(element_size)
        if len(self.rows) != batch:
            if self.rows:
                raise ValueError(f"the cache holds {len(self.rows)} rows but the model was called with batch {batch}")
            self.rows = [_Row(tables={g: [] for g in self.groups}) for _ in range(batch)]
        start = self.paged[0].length
        bs = self.block_size
        for group in self.groups:
            pool = self.pools[group]
            # Allocate first for every row, so a CacheFullError leaves the cache unchanged.
            needs = []
            for row in self.rows:
                table = row.tables[group]
                stored_start, stored_end = max(0, start - row.pad), max(0, start + new - row.pad)
                copy = stored_start % bs != 0 and stored_start < stored_end and pool.is_shared(
                    table[stored_start // bs]
                )
                needs.append((-(-stored_end // bs) - len(table), copy))
            self._reserve(group, sum(n + c for n, c in needs))
            for row, (n, copy) in zip(self.rows, needs):
                table = row.tables[group]
                if copy:
                    self._copy_on_write(table, max(0, start - row.pad) // bs, group)
                table.extend(pool.allocate(n) if n > 0 else [])
            if group is not None:
                self._free_out_of_window(group, start)
            self._update_slots(group, start, new, device)

    def _reserve(self, group, blocks: int) -> None:
        pool = self.pools[group]
        while self.growable and blocks > pool.num_available():
            self._grow_pool(group)
        if blocks > pool.num_available():
            pool.allocate(blocks)  # raises CacheFullError naming the numbers, changes nothing

    def _copy_on_write(self, table: list[int], k: int, group) -> None:
        pool = self.pools[group]
        old, (new,) = table[k], pool.allocate(1)
        for layer in self.paged:
            if layer.window == group and layer.storage is not None:
                layer.storage[new] = layer.storage[old]
        pool.free(old)
        table[k] = new
        self._read.clear()  # the table changed under the kept read slots

    def _free_out_of_window(self, window: int, start: int) -> None:
        """Positions <= start - window are out of every future query's window: free blocks made only of them."""
        for row in self.rows:
            table = row.tables[window]
            dead = max(0, start - window + 1 - row.pad)  # stored positions < dead are invisible from now on
            for k in range(min(dead // self.block_size, len(table))):
                if table[k] != NULL_BLOCK:
                    self.pools[window].free(table[k])
                    table[k] = NULL_BLOCK
                    self._read.clear()

    def _update_slots(self, group, start: int, new: int, device) -> None:
        """Slots of this step: write [B, new] (-1: padding, not stored) and read [B, start + new].

        Read slots of the cached positions are kept between steps and only extended, unless the block tables
        changed under them (a new request, beams, forks, crops, copies, window frees): then they are rebuilt.
        A slot is block * block_size + offset; slots in the null block read zeros.
        """
        first = self._contiguous_from.get(group)
        if first is not None and len(self.rows) == 1 and self._read.get(group) is None and start:
            # One contiguous row, decoding: if the new positions extend the run, nothing needs building.
            row, bs = self.rows[0], self.block_size
            table = row.tables[group]
            if all(table[(p - row.pad) // bs] * bs + (p - row.pad) % bs == first + p for p in range(start, start + new)):
                self._write_all_valid[group] = True
                return
            self._contiguous_from[group] = None
        old = self._read.get(group)
        rebuilt = old is None or old.shape != (len(self.rows), start)
        if rebuilt:
            old = self._slots(group, 0, start).clamp(min=0).to(device)
        write = self._slots(group, start, start + new).to(device)
        self._write[group] = write
        self._write_all_valid[group] = bool((write >= 0).all())
        read = self._read[group] = torch.cat((old, write.clamp(min=0)), dim=1)
        # A single row stored in consecutive slots (the usual case for one request) is read as a storage view:
        # _contiguous_from[group] = c means position p sits in slot c + p.
        first = None
        if len(self.rows) == 1 and not self.rows[0].pad and self._write_all_valid[group]:
            if rebuilt:
                first = int(read[0, 0]) if bool((read[0, 1:] - read[0, :-1] == 1).all()) else None
            else:
                first = self._contiguous_from.get(group)
                consecutive = new == 1 or bool((write[0, 1:] - write[0, :-1] == 1).all())
                if first is not None and not (int(write[0, 0]) == first + start and consecutive):
                    first = None
        self._contiguous_from[group] = first
        if first is not None:
            del self._read[group]  # read as a storage view; rebuilt from the tables if that ever stops

    def _slots(self, group, start: int, end: int) -> torch.Tensor:
        """[B, end - start] slot ids of positions [start, end) of every row; -1 for left padding."""
        bs = self.block_size
        if end - start == 1:  # a decode step: plain integer arithmetic beats a dozen tiny tensor ops
            slots = []
            for row in self.rows:
                stored = start - row.pad
                slots.append([row.tables[group][stored // bs] * bs + stored % bs if stored >= 0 else -1])
            return torch.tensor(slots, dtype=torch.long)
        positions = torch.arange(start, end)
        out = []
        for row in self.rows:
            table = torch.tensor(row.tables[group] or [NULL_BLOCK], dtype=torch.long)
            stored = positions - row.pad
            index = stored.clamp(min=0)
            slots = table[(index // bs).clamp(max=len(table) - 1)] * bs + index % bs
            out.append(torch.where(stored >= 0, slots, -1))
        return torch.stack(out) if out else torch.empty(0, end - start, dtype=torch.long)

    def _end_step(self) -> None:
        """Name the prompt blocks that just became full, so later requests can reuse them."""
        if not self.prefix_caching:
            return
        length, pool = self.paged[0].length, self.pools[None]
        for row in self.rows:
            table = row.tables[None]
            full = min((length - row.pad) // self.block_size, len(row.hashes))
            for k in range(row.registered, max(0, full)):
                kept = pool.register(table[k], row.hashes[k])
                if kept != table[k]:  # an equal block exists (e.g. a forked row): share it, free ours
                    pool.incref(kept)
                    pool.free(table[k])
                    table[k] = kept
                    self._read.clear()
            row.registered = max(row.registered, full)

    # -- pool and storage ------------------------------------------------------------------------------------

    def bytes_per_block(self, group, element_size: int) -> int:
        """Bytes one block of `group` takes: block_size tokens of every layer in the group."""
        return self.group_values[group] * self.block_size * element_size

    def _create_pools(self, element_size: int) -> None:
        """Fixed pools from num_blocks (each group) or max_memory (split by each group's bytes per token)."""
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
            self.pools[group] = BlockPool(blocks)

    def _grow_pool(self, group) -> None:
        pool = self.pools[group]
        pool.grow(pool.num_blocks)
        for layer in self.paged:
            if layer.window == group and layer.storage is not None:
                self._grow_storage(layer, None, None)

    def _grow_storage(self, layer: PagedLayer, keys, values) -> None:
        """Allocate (first call) or extend this layer's storage to pool.num_blocks blocks; new blocks are zero."""
        num_blocks = self.pools[layer.window].num_blocks
        if layer.storage is None:
            if keys.shape[1] != values.shape[1]:
                raise ValueError(f"keys have {keys.shape[1]} heads and values {values.shape[1]}: they must match")
            layer.key_dim = keys.shape[-1]
            shape = (num_blocks, self.block_size, keys.shape[1], keys.shape[-1] + values.shape[-1])
            layer.storage = keys.new_zeros(shape)
            return
        extra = num_blocks - layer.storage.shape[0]
        if extra > 0:
            layer.storage = torch.cat((layer.storage, layer.storage.new_zeros(extra, *layer.storage.shape[1:])))

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
        self._read.clear()
        old = self.rows
        self.rows = [self._fork(old[i]) for i in sources]
        for row in old:
            self._drop(row)

    def _pass_through_layers(self) -> list:
        return [layer for layer in self.layers if not isinstance(layer, PagedLayer)]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove positions (transformers' convention: a non-positive count; assisted
        decoding rolls back rejected draft tokens with it). Whole blocks past the new end are freed."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove")
        keep = max(0, self.get_seq_length() + tokens_to_remove)
        self._read.clear()
        for row in self.rows:
            stored = max(0, keep - row.pad)
            for group, table in row.tables.items():
                while len(table) > -(-stored // self.block_size):
                    self.pools[group].free(table.pop())
        for layer in self.paged:
            layer.length = keep
        for layer in self._pass_through_layers():
            layer.crop(tokens_to_remove)

    def reset(self) -> None:
        self._release_rows()
        super().reset()

    def _fork(self, row: _Row) -> _Row:
        for group, table in row.tables.items():
            for block in table:
                self.pools[group].incref(block)
        return _Row(row.pad, row.tokens, {g: list(t) for g, t in row.tables.items()}, row.hashes, row.registered)

    def _drop(self, row: _Row) -> None:
        for group, table in row.tables.items():
            for block in table:
                self.pools[group].free(block)

    # -- accounting ------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Memory and prefix-cache figures for the KV storage of the paged layers.

        allocated_bytes: blocks referenced by live rows; used_bytes: the token slots of those blocks that hold
        tokens (a block shared by several rows counts once); utilization = used / allocated.
        """
        layer = self.paged[0] if self.paged else None
        element_size = layer.storage.element_size() if layer is not None and layer.storage is not None else 0
        allocated = used = 0
        for group in self.groups:
            filled = {}  # block -> slots holding tokens
            for row in self.rows:
                stored = max(0, layer.length - row.pad)
                for k, block in enumerate(row.tables[group]):
                    if block != NULL_BLOCK:
                        filled[block] = max(filled.get(block, 0), min(self.block_size, stored - k * self.block_size))
            per_slot = self.group_values[group] * element_size
            allocated += len(filled) * self.block_size * per_slot
            used += sum(filled.values()) * per_slot
        pools = list(self.pools.values())
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
