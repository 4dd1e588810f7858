"""Bookkeeping of fixed-size KV blocks: reference counts, a free list, and the prefix-cache table.

No tensors live here; the paged cache owns the storage and asks this pool which block ids to use.

Invariants (checked by tests/test_block_pool.py with hypothesis):
- Block 0 is the null block: never handed out, never freed, its refcount is not kept. Block tables point at it for
  positions that hold nothing (left padding, tokens slid out of a window); its storage stays zero.
- Every other block is in exactly one state: *free* (refcount 0, no hash, in `_free`), *cached* (refcount 0, has a
  hash, in `_evictable`, reusable by a prefix hit until evicted), or *live* (refcount >= 1, maybe hashed).
- A hashed block's content is immutable: writers copy it first (copy-on-write), so a prefix hit always reads the
  tokens its hash names.
- allocate() prefers free blocks and evicts cached ones least-recently-used first; it never returns a live block.
"""

from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK = 0


class CacheFullError(RuntimeError):
    """The pool has fewer free blocks than a request needs."""

    def __init__(self, requested: int, available: int, total: int):
        super().__init__(
            f"KV cache full: {requested} blocks requested, {available} free or evictable of {total} "
            "(raise num_blocks / max_memory, or shorten the batch)"
        )
        self.requested, self.available, self.total = requested, available, total


class BlockPool:
    """Block ids 1..num_blocks-1 with reference counts and a hash -> block table for prefix caching."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks!r} must be an integer >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0

    # -- queries ---------------------------------------------------------------------------------------------

    def num_available(self) -> int:
        """Blocks allocate() can hand out now: free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    def num_live(self) -> int:
        return self.num_blocks - 1 - self.num_available()

    def num_cached(self) -> int:
        """Unreferenced blocks kept for prefix hits."""
        return len(self._evictable)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def is_shared(self, block: int) -> bool:
        """True when writing into `block` must copy it first: another reference exists or its content is hashed."""
        return self._refcount[block] > 1 or block in self._hash_of

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    # -- changes ---------------------------------------------------------------------------------------------

    def allocate(self, n: int = 1) -> list[int]:
        """n blocks with refcount 1, all or none (raises CacheFullError without changing anything)."""
        if n > self.num_available():
            raise CacheFullError(n, self.num_available(), self.num_blocks - 1)
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently used cached block
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
                self.evictions += 1
            self._refcount[block] = 1
            out.append(block)
        return out

    def take(self, block: int) -> bool:
        """Hand out this particular block (refcount 1) if it is free; False, changing nothing, if it is not
        (cached blocks are not taken: evicting one out of LRU order would lose a prefix hit)."""
        if not 0 < block < self.num_blocks or self._refcount[block] or block in self._hash_of:
            return False
        self._free.remove(block)
        self._refcount[block] = 1
        return True

    def free_run(self, n: int) -> int | None:
        """The first block of the lowest run of n consecutive free blocks (not cached, not live), or None."""
        run = 0
        for block in range(1, self.num_blocks):
            run = run + 1 if not self._refcount[block] and block not in self._hash_of else 0
            if run == n:
                return block - n + 1
        return None

    def incref(self, block: int) -> None:
        """Take one more reference (a fork, a beam, or a prefix hit on a cached block)."""
        if block == NULL_BLOCK:
            return
        if self._refcount[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"block {block} is free: it cannot gain a reference")
            del self._evictable[block]
        self._refcount[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; at zero the block becomes cached (if hashed) or free."""
        if block == NULL_BLOCK:
            return
        if self._refcount[block] <= 0:
            raise ValueError(f"double free of block {block}")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None  # most recently used end
            else:
                self._free.append(block)

    def register(self, block: int, block_hash: bytes) -> int:
        """Record that live `block` holds the full block named by `block_hash`; returns the block to keep using.

        If another block already holds that hash, the existing one wins (the caller swaps to it and frees its own),
        so one hash names one block.
        """
        existing = self._block_of.get(block_hash)
        if existing is not None and existing != block:
            return existing
        if block not in self._hash_of:
            self._hash_of[block] = block_hash
            self._block_of[block_hash] = block
        return block

    def grow(self, extra: int) -> None:
        """Add `extra` free blocks (ids num_blocks .. num_blocks+extra-1)."""
        start = self.num_blocks
        self.num_blocks += extra
        self._refcount.extend([0] * extra)
        self._free[:0] = range(self.num_blocks - 1, start - 1, -1)  # handed out after the older free blocks
