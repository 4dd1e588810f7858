"""The KV manager: the one owner of block tables, prefix hits, block registration, copy-on-write, window frees,
rollback and preemption. No tensors live here; whoever owns the storage (the engine's runner, PagedKVCache) asks
the manager where each token goes and applies the block copies it reports.

Groups. Layers with the same attention span share one block table per sequence and one BlockPool: group `None` is
full attention, group `w` (an int) the layers with sliding window w. Constant-state layers (SSM, linear attention)
hold no blocks and are not a group: with `state_slots`, each sequence also holds a state slot from `add` to `free`
(cache/state_pool.py); the state tensors are the storage owner's. Such a manager has no prefix caching, and
refuses fork() and crop() (a recurrent state can be neither shared block-wise nor cut back).

Positions. A sequence's stored position p (0-based, padding excluded) lives in block `table[p // block_size]` at
offset `p % block_size`; slot = block * block_size + offset. Entries equal to NULL_BLOCK hold nothing (tokens slid
out of every window, or blocks freed by nobody's need); reading them gives zeros, which the mask hides.

Invariants (tests/test_kv_manager.py checks them under random operation sequences):
- every block reference held by a table is counted once in its pool (refcount == number of table entries naming it);
- a block with a hash is never written: a write into a shared or hashed block first moves the table entry to a
  fresh copy (reported by `take_copies()`, which the storage owner must apply before writing);
- `allocate()` changes nothing when it raises CacheFullError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers.cache_utils import get_layer_types_and_kwargs

from .block_pool import NULL_BLOCK, BlockPool, CacheFullError
from .prefix_cache import block_hashes
from .state_pool import StateSlots

__all__ = ["KVManager", "CacheFullError", "STATE", "layer_groups"]

STATE = "state"  # a constant-size state layer (SSM, linear attention, conv; KV-sharing "dummy" layers hold nothing)
_STATE_TYPES = ("linear_attention", "conv", "dummy")


def layer_groups(config) -> list:
    """Per layer of a (text) config: None (full attention), the window w (sliding attention) or STATE."""
    out = []
    for idx, (kind, kwargs) in enumerate(zip(*get_layer_types_and_kwargs(config))):
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            out.append(int(kwargs["sliding_window"]))
        elif kind in _STATE_TYPES:
            out.append(STATE)
        else:
            raise ValueError(f"layer type {kind!r} (layer {idx}) has no paged KV layout")
    return out


@dataclass
class _Sequence:
    tables: dict  # group -> list of block ids
    hashes: list[bytes] = field(default_factory=list)  # hash chain of the leading full blocks named in the pool
    homes: dict = field(default_factory=dict)  # group -> block wanted at table position 0 (reserve_runs)


class KVManager:
    """Block tables for sequences keyed by any hashable id.

    Args:
        block_size: tokens per block.
        num_blocks: pool size per group ({group: n}; an int gives every group n). Block 0 of each is the null block.
        groups: the groups (None: full attention; int: sliding window size).
        prefix_caching: name full blocks by hash so later sequences with the same prefix reuse them (only when the
            only group is full attention: a windowed block is not reusable once its neighbours are freed).
        growable: a pool that runs out doubles instead of raising (PagedKVCache without a memory limit).
        state_slots: the model has constant-state layers: one state slot per live sequence, this many at most.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks,
        groups=(None,),
        prefix_caching: bool = True,
        growable: bool = False,
        state_slots: int = 0,
    ):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive integer")
        self.block_size = block_size
        self.groups = list(groups)
        sizes = num_blocks if isinstance(num_blocks, dict) else {g: num_blocks for g in self.groups}
        self.pools = {g: BlockPool(sizes[g]) for g in self.groups}
        self.states = StateSlots(state_slots) if state_slots else None
        self.prefix_caching = prefix_caching and self.groups == [None] and self.states is None
        self.growable = growable
        self.sequences: dict = {}
        self._copies: list[tuple] = []  # (group, source block, destination block) not yet applied to the storage
        self.version = 0  # bumped whenever an existing table entry changes (copy, dedupe, window free, crop, fork)

    # -- queries ---------------------------------------------------------------------------------------------

    def table(self, seq_id, group=None) -> list[int]:
        return self.sequences[seq_id].tables[group]

    def state_slot(self, seq_id) -> int:
        """The state slot of a live sequence (a manager made with state_slots)."""
        return self.states.slot(seq_id)

    def num_free_blocks(self, group=None) -> int:
        return self.pools[group].num_available()

    @property
    def num_blocks(self) -> int:
        """Blocks of the smallest pool (block 0, the null block, included)."""
        return min(pool.num_blocks for pool in self.pools.values())

    def num_live_blocks(self) -> int:
        """Blocks referenced by some sequence, over all pools."""
        return sum(pool.num_live() for pool in self.pools.values())

    def block_stats(self) -> dict:
        """Blocks over all pools (the null blocks left out): total, used (referenced), cached (unreferenced, kept for
        prefix hits), free."""
        pools = list(self.pools.values())
        total = sum(p.num_blocks - 1 for p in pools)
        used, cached = sum(p.num_live() for p in pools), sum(p.num_cached() for p in pools)
        return {
            "block_size": self.block_size,
            "blocks_total": total,
            "blocks_used": used,
            "blocks_cached": cached,
            "blocks_free": total - used - cached,
        }

    def can_allocate(self, seq_id, start: int, end: int) -> bool:
        seq = self.sequences.get(seq_id)
        return self.growable or all(
            self._need(seq.tables[g] if seq else [], start, end, g)[0] <= self.pools[g].num_available()
            for g in self.groups
        )

    def cached_prefix_blocks(self, tokens) -> list[bytes]:
        """Hashes of the leading full blocks of `tokens` that are cached now (the block holding the last token
        excluded: its logits must be computed)."""
        if not self.prefix_caching:
            return []
        pool, out = self.pools[None], []
        for name in block_hashes(tokens[: ((len(tokens) - 1) // self.block_size) * self.block_size], self.block_size):
            if pool.lookup(name) is None:
                break
            out.append(name)
        return out

    # -- changes ---------------------------------------------------------------------------------------------

    def add(self, seq_id) -> None:
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id!r} is already in the KV manager")
        if self.states is not None:
            self.states.allocate(seq_id)
        self.sequences[seq_id] = _Sequence({g: [] for g in self.groups})

    def attach_prefix(self, seq_id, hashes: list[bytes], num_tokens: int | None = None) -> int:
        """Share the cached blocks named by `hashes` as the sequence's first blocks (a new, empty sequence).

        num_tokens (default: all of them) may end inside a block: that block is shared too and copied on the
        first write into it. Returns the number of positions now held."""
        seq = self.sequences[seq_id]
        if any(seq.tables.values()):
            raise ValueError(f"attach_prefix: sequence {seq_id!r} already holds blocks")
        num_tokens = len(hashes) * self.block_size if num_tokens is None else num_tokens
        count = -(-num_tokens // self.block_size)
        if not count:
            return 0
        if count > len(hashes):
            raise ValueError(f"attach_prefix: {num_tokens} tokens need {count} cached blocks, {len(hashes)} given")
        pool = self.pools[None]
        for name in hashes[:count]:
            block = pool.lookup(name)
            pool.incref(block)
            seq.tables[None].append(block)
        seq.hashes = list(hashes[: num_tokens // self.block_size])
        return num_tokens

    def reserve_runs(self, seq_ids: list, blocks_each: int, skips: list[int] | None = None) -> bool:
        """Lay out empty sequences side by side: sequence i's k-th block is taken at block
        base + i * blocks_each + skips[i] + k while that block is free (skips: blocks each run leaves unused at its
        start, e.g. a row's whole blocks of left padding), so their tables stay consecutive runs at one stride (the
        storage owner can read all of them as one strided view, with no gather). Placement only: nothing is
        allocated, and a wanted block that is taken already is replaced by any free one. Returns False, changing
        nothing, when some pool has no such run (a growable pool does not grow for it: its blocks stay allocated on
        demand)."""
        skips = skips or [0] * len(seq_ids)
        if blocks_each < 1 or any(any(self.sequences[s].tables.values()) for s in seq_ids):
            raise ValueError(f"reserve_runs: blocks_each={blocks_each!r} must be >= 1 and the sequences empty")
        if len(skips) != len(seq_ids) or not all(0 <= k < blocks_each for k in skips):
            raise ValueError(f"reserve_runs: skips={skips!r} must give each sequence 0 <= skip < {blocks_each}")
        homes, need = {}, len(seq_ids) * blocks_each
        for g, pool in self.pools.items():
            homes[g] = pool.free_run(need)
            if homes[g] is None:
                return False
        for i, seq_id in enumerate(seq_ids):
            self.sequences[seq_id].homes = {g: home + i * blocks_each + skips[i] for g, home in homes.items()}
        return True

    def allocate(self, seq_id, start: int, end: int) -> None:
        """Make positions [start, end) writable: new blocks up to `end`, and a private copy of the block holding
        `start` when it is shared or hashed (copy-on-write). All or nothing: raises CacheFullError unchanged."""
        self.allocate_many([(seq_id, start, end)])

    def allocate_many(self, requests: list[tuple]) -> None:
        """allocate() for several (seq_id, start, end) at once, all or nothing (a batch of generate() rows)."""
        needs = [
            (seq_id, start, g, *self._need(self.sequences[seq_id].tables[g], start, end, g))
            for seq_id, start, end in requests
            for g in self.groups
        ]
        for g in self.groups:
            n, pool = sum(need[3] for need in needs if need[2] == g), self.pools[g]
            while self.growable and n > pool.num_available():
                pool.grow(pool.num_blocks)
            if n > pool.num_available():
                raise CacheFullError(n, pool.num_available(), pool.num_blocks - 1)
        for seq_id, start, g, n, copy in needs:
            seq = self.sequences[seq_id]
            table, pool = seq.tables[g], self.pools[g]
            if copy:
                k = start // self.block_size
                (new,) = pool.allocate(1)
                self._copies.append((g, table[k], new))
                pool.free(table[k])
                table[k] = new
                del seq.hashes[k:]  # the copy will differ from the hashed block
                self.version += 1
                n -= 1
            home = seq.homes.get(g)
            if home is None:
                table.extend(pool.allocate(n))
            else:  # the reserved run's next block when it is still free (the count above covers either choice)
                for _ in range(n):
                    table.append(home + len(table) if pool.take(home + len(table)) else pool.allocate(1)[0])

    def take_copies(self) -> list[tuple]:
        """Pending (group, source, destination) block copies; the storage owner applies them before writing."""
        copies, self._copies = self._copies, []
        return copies

    def free_out_of_window(self, seq_id, start: int) -> None:
        """Queries from position `start` on see keys > start - window: free each window group's blocks made only of
        earlier positions (their entries become NULL_BLOCK)."""
        seq = self.sequences[seq_id]
        for g in self.groups:
            if g is None:
                continue
            table, pool = seq.tables[g], self.pools[g]
            dead = max(0, start - g + 1) // self.block_size  # blocks wholly before the first visible position
            for k in range(min(dead, len(table))):
                if table[k] != NULL_BLOCK:
                    pool.free(table[k])
                    table[k] = NULL_BLOCK
                    self.version += 1

    def commit(self, seq_id, tokens) -> None:
        """Name the sequence's full blocks whose K/V is now written (`tokens`: its tokens so far, all computed), so
        later sequences can reuse them; an equal block cached already replaces ours (one block per name)."""
        if not self.prefix_caching:
            return
        seq, pool, size = self.sequences[seq_id], self.pools[None], self.block_size
        table, full = seq.tables[None], min(len(tokens) // size, len(seq.tables[None]))
        if len(seq.hashes) >= full:
            return
        parent = seq.hashes[-1] if seq.hashes else b""
        start = len(seq.hashes)
        for k, name in enumerate(block_hashes(tokens[start * size : full * size], size, parent), start):
            kept = pool.register(table[k], name)
            if kept != table[k]:  # an identical block exists: share it, free ours
                pool.incref(kept)
                pool.free(table[k])
                table[k] = kept
                self.version += 1
            seq.hashes.append(name)

    def fork(self, source, seq_id) -> None:
        """A new sequence sharing every block of `source` (beams, num_return_sequences); writes copy on write."""
        if self.states is not None:
            raise ValueError(
                f"fork({source!r}): constant-state layers (SSM / linear attention) cannot share a "
                "state copy-on-write; run each sequence from its own prompt"
            )
        src = self.sequences[source]
        self.add(seq_id)
        seq = self.sequences[seq_id]
        for g, table in src.tables.items():
            for block in table:
                self.pools[g].incref(block)
            seq.tables[g] = list(table)
        seq.hashes = list(src.hashes)
        self.version += 1

    def crop(self, seq_id, num_tokens: int) -> None:
        """Keep positions [0, num_tokens) (speculative rollback): whole blocks past them are freed; a kept block
        that is hashed stays so, and the next write into it copies it."""
        if self.states is not None:
            raise ValueError(
                f"crop({seq_id!r}, {num_tokens}): constant-state layers (SSM / linear attention) "
                "cannot roll their state back"
            )
        seq = self.sequences[seq_id]
        keep = -(-max(0, num_tokens) // self.block_size)
        for g, table in seq.tables.items():
            while len(table) > keep:
                self.pools[g].free(table.pop())
        del seq.hashes[max(0, num_tokens) // self.block_size :]
        self.version += 1

    def free(self, seq_id) -> None:
        """Release a finished or preempted sequence: its blocks return to the pools (hashed ones stay cached)."""
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return
        if self.states is not None:
            self.states.free(seq_id)
        for g, table in seq.tables.items():
            for block in reversed(table):  # tail first: the prefix is evicted last (LRU order)
                self.pools[g].free(block)

    # -- helpers ---------------------------------------------------------------------------------------------

    def _need(self, table: list[int], start: int, end: int, group) -> tuple[int, bool]:
        """(blocks to take, whether the block holding `start` must be copied first) for writing [start, end)."""
        bs = self.block_size
        new = max(0, -(-end // bs) - len(table))
        k = start // bs
        copy = start < end and k < len(table) and table[k] != NULL_BLOCK and self.pools[group].is_shared(table[k])
        return new + copy, copy
