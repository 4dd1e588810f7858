"""BlockPool: exact ids and eviction order, and hypothesis-driven invariants over random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_attn_patch.cache import NULL_BLOCK, BlockPool, CacheFullError


def test_ids_eviction_order_and_errors():
    pool = BlockPool(5)  # blocks 1..4; 0 is the null block
    a, b, c = pool.allocate(3)
    assert (a, b, c) == (1, 2, 3)
    assert pool.register(a, b"h-a") == a and pool.register(b, b"h-b") == b
    pool.free(b)
    pool.free(a)  # both cached now; b was released first, so b is the least recently used
    assert pool.num_cached() == 2 and pool.lookup(b"h-a") == a
    assert pool.allocate(1) == [4]  # free blocks go before cached ones
    assert pool.allocate(1) == [b] and pool.lookup(b"h-b") is None  # LRU eviction drops its hash
    pool.incref(a)  # a prefix hit revives a cached block
    assert pool.refcount(a) == 1 and pool.num_cached() == 0
    with pytest.raises(CacheFullError, match="1 blocks requested, 0 free or evictable of 4"):
        pool.allocate(1)
    pool.free(c)
    with pytest.raises(ValueError, match="double free of block 3"):
        pool.free(c)
    with pytest.raises(ValueError, match="block 3 is free"):
        pool.incref(c)
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(1)


def test_take_a_particular_block_and_find_free_runs():
    pool = BlockPool(8)  # blocks 1..7
    assert pool.free_run(7) == 1 and pool.free_run(8) is None
    assert pool.take(3) and pool.refcount(3) == 1
    assert not pool.take(3) and not pool.take(0) and not pool.take(8)  # live, the null block, out of range
    assert pool.free_run(2) == 1 and pool.free_run(3) == 4  # 1-2 free, 3 live, 4-7 free
    (cached,) = pool.allocate(1)  # the lowest free block: 1
    pool.register(cached, b"h")
    pool.free(cached)
    assert cached == 1 and not pool.take(cached)  # cached blocks are not taken (they would lose a prefix hit)
    assert pool.free_run(1) == 2 and pool.allocate(1) == [2]  # take() left the free list's order intact
    assert pool.num_available() == 5 and pool.num_live() == 2


def test_register_keeps_one_block_per_hash_and_shared_means_copy_first():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert not pool.is_shared(a)
    assert pool.register(a, b"same") == a
    assert pool.is_shared(a)  # hashed content is immutable: a writer must copy it
    assert pool.register(b, b"same") == a  # b's owner is told to switch to a
    pool.incref(b)
    assert pool.is_shared(b)  # two references


def test_allocation_is_all_or_nothing_and_grow_adds_free_blocks():
    pool = BlockPool(3)
    with pytest.raises(CacheFullError):
        pool.allocate(3)
    assert pool.num_available() == 2
    pool.grow(3)
    assert pool.num_available() == 5 and sorted(pool.allocate(5)) == [1, 2, 3, 4, 5]


OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "fork", "free", "register", "hit"]), st.integers(0, 10**6)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(2, 12), ops=OPS)
def test_random_operations_never_leak_double_free_or_alias(num_blocks, ops):
    """Model: `owners` holds one entry per reference; the pool must agree with it after every step."""
    pool = BlockPool(num_blocks)
    owners: list[int] = []
    hashes: dict[int, bytes] = {}
    for op, seed in ops:
        if op == "alloc":
            n = seed % 3 + 1
            if n > pool.num_available():
                before = pool.num_available()
                with pytest.raises(CacheFullError):
                    pool.allocate(n)
                assert pool.num_available() == before  # nothing changed
                continue
            got = pool.allocate(n)
            assert NULL_BLOCK not in got and len(set(got)) == n
            assert not set(got) & set(owners)  # never alias a live block
            for block in got:
                hashes.pop(block, None)  # an evicted block lost its hash
            owners += got
        elif op == "fork" and owners:
            block = owners[seed % len(owners)]
            pool.incref(block)
            owners.append(block)
        elif op == "free" and owners:
            pool.free(owners.pop(seed % len(owners)))
        elif op == "register" and owners:
            block = owners[seed % len(owners)]
            if block not in hashes:
                name = seed.to_bytes(4, "little")
                kept = pool.register(block, name)
                if kept == block:
                    hashes[block] = name
        elif op == "hit" and hashes:
            block, name = list(hashes.items())[seed % len(hashes)]
            if pool.lookup(name) == block:
                pool.incref(block)
                owners.append(block)
        # invariants
        live = set(owners)
        for block in range(1, num_blocks):
            assert pool.refcount(block) == owners.count(block)
        assert pool.num_live() == len(live)
        assert pool.num_available() == num_blocks - 1 - len(live)  # no leak: every block is live, cached or free
        assert pool.num_cached() == len({b for b in hashes if b not in live and pool.lookup(hashes[b]) == b})
