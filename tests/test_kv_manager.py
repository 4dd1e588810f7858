"""KVManager: exact block ids, prefix hits and eviction order, copy-on-write, window frees, crop; and invariants
under random operation sequences (no leak, no double free, no alias of a writable block)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_attn_patch.cache import NULL_BLOCK, CacheFullError
from hf_attn_patch.cache.manager import STATE, KVManager, layer_groups

from .conftest import tiny_config


def test_allocation_prefix_hits_and_eviction_order():
    kv = KVManager(block_size=4, num_blocks=8)  # blocks 1..7
    kv.add("a")
    kv.allocate("a", 0, 10)  # 10 tokens: 3 blocks
    assert kv.table("a") == [1, 2, 3]
    tokens = list(range(100, 110))
    kv.commit("a", tokens)  # two full blocks are named; the partial third is not
    assert kv.pools[None].lookup(kv.sequences["a"].hashes[1]) == 2 and len(kv.sequences["a"].hashes) == 2
    kv.free("a")
    assert kv.num_live_blocks() == 0 and kv.pools[None].num_cached() == 2
    # a later prompt with the same first 8 tokens (and more) reuses blocks 1 and 2, and computes from position 8
    hits = kv.cached_prefix_blocks(tokens[:8] + [7, 7, 7])
    kv.add("b")
    assert kv.attach_prefix("b", hits) == 8 and kv.table("b") == [1, 2]
    # a prompt that *is* the cached prefix keeps its last block to compute (its logits are needed)
    assert len(kv.cached_prefix_blocks(tokens[:8])) == 1
    kv.free("b")  # tail first: block 2 is now the least recently used cached block
    kv.add("c")
    kv.allocate("c", 0, 24)  # 6 blocks: 5 free ones (3..7), then the LRU cached one (2), never 1 first
    assert kv.table("c") == [3, 4, 5, 6, 7, 2]
    assert kv.pools[None].lookup(hits[1]) is None and kv.pools[None].lookup(hits[0]) == 1
    with pytest.raises(CacheFullError):
        kv.allocate("c", 24, 32)  # needs 2 more, 1 is left: nothing changes
    assert kv.table("c") == [3, 4, 5, 6, 7, 2] and kv.num_free_blocks() == 1


def test_commit_dedupes_equal_blocks():
    kv = KVManager(block_size=2, num_blocks=6)
    for name in ("a", "b"):
        kv.add(name)
        kv.allocate(name, 0, 4)
    assert kv.table("a") == [1, 2] and kv.table("b") == [3, 4]
    kv.commit("a", [1, 2, 3, 4])
    kv.commit("b", [1, 2, 3, 4])  # same tokens: b shares a's blocks and frees its own
    assert kv.table("b") == [1, 2] and kv.pools[None].refcount(1) == 2 and kv.num_free_blocks() == 3


def test_fork_copy_on_write_and_crop():
    kv = KVManager(block_size=4, num_blocks=6, prefix_caching=False)
    kv.add("a")
    kv.allocate("a", 0, 6)
    kv.fork("a", "b")  # b shares blocks 1, 2
    kv.allocate("b", 6, 7)  # b writes into shared block 2 at offset 2: it gets a copy
    assert kv.table("a") == [1, 2] and kv.table("b") == [1, 3]
    assert kv.take_copies() == [(None, 2, 3)] and kv.take_copies() == []
    kv.allocate("a", 6, 7)  # a is now the only holder of 2: no copy
    assert kv.table("a") == [1, 2] and kv.take_copies() == []
    kv.allocate("a", 7, 13)
    assert kv.table("a") == [1, 2, 4, 5]
    kv.crop("a", 5)  # speculative rollback: keep 5 positions = 2 blocks
    assert kv.table("a") == [1, 2] and kv.num_free_blocks() == 2
    kv.free("a"), kv.free("b")
    assert kv.num_live_blocks() == 0


def test_sliding_window_frees_blocks_no_query_sees():
    kv = KVManager(block_size=4, num_blocks=10, groups=[None, 6])
    kv.add("a")
    kv.allocate("a", 0, 12)
    assert kv.table("a", None) == [1, 2, 3] and kv.table("a", 6) == [1, 2, 3]
    kv.free_out_of_window("a", 9)  # a query at 9 sees keys 4..9: block 0 (positions 0..3) is dead
    assert kv.table("a", 6) == [NULL_BLOCK, 2, 3] and kv.table("a", None) == [1, 2, 3]
    kv.free_out_of_window("a", 10)  # sees 5..10: block 1 still holds 5..7
    assert kv.table("a", 6) == [NULL_BLOCK, 2, 3]
    assert kv.num_free_blocks(6) == 7 and kv.num_free_blocks(None) == 6
    assert not kv.prefix_caching  # windowed blocks are not reusable prefixes


def test_layer_groups_of_configs():
    assert layer_groups(tiny_config("llama")) == [None, None]
    mistral = tiny_config("mistral", sliding_window=8)
    assert layer_groups(mistral) == [8] * mistral.num_hidden_layers
    qwen = tiny_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=3)
    assert layer_groups(qwen) == [None, 8, 8]
    qwen.layer_types = ["full_attention", "linear_attention", "sliding_attention"]
    assert layer_groups(qwen) == [None, STATE, 8]


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="block_size=0"):
        KVManager(block_size=0, num_blocks=4)
    kv = KVManager(block_size=2, num_blocks=4)
    kv.add("a")
    with pytest.raises(ValueError, match="'a' is already"):
        kv.add("a")


def test_reserved_runs_keep_tables_consecutive_at_one_stride():
    kv = KVManager(block_size=4, num_blocks=16, prefix_caching=False)
    for seq in "abc":
        kv.add(seq)
    assert kv.reserve_runs(["a", "b"], 3)  # a's blocks from 1, b's from 4
    kv.allocate_many([("a", 0, 6), ("b", 0, 6)])
    assert kv.table("a") == [1, 2] and kv.table("b") == [4, 5]
    kv.allocate("c", 0, 4)  # an unplaced sequence takes the lowest free block: 3, inside a's run
    assert kv.table("c") == [3]
    kv.allocate("a", 6, 12)  # a's third wanted block (3) is taken: any free block instead
    kv.allocate("b", 6, 12)
    assert kv.table("a") == [1, 2, 6] and kv.table("b") == [4, 5, 7]
    kv.crop("b", 4)  # rollback frees b's blocks 5 and 7; growing again takes the wanted block 5 back
    kv.allocate("b", 4, 8)
    assert kv.table("b") == [4, 5]
    with pytest.raises(ValueError, match="blocks_each=3 must be >= 1 and the sequences empty"):
        kv.reserve_runs(["a"], 3)
    small = KVManager(block_size=4, num_blocks=4)
    small.add("x"), small.add("y")
    assert not small.reserve_runs(["x", "y"], 2)  # 4 consecutive free blocks do not exist in 1..3
    assert small.sequences["x"].homes == {} and small.pools[None].num_available() == 3
    grows = KVManager(block_size=4, num_blocks=4, growable=True)
    grows.add("x"), grows.add("y")
    assert not grows.reserve_runs(["x", "y"], 3) and grows.pools[None].num_blocks == 4  # no growing for placement
    assert grows.reserve_runs(["x", "y"], 1)  # runs of one block: x wants 1, 2, ... and y 2, 3, ...
    grows.allocate_many([("x", 0, 8), ("y", 0, 8)])  # the pool doubles for the 4 blocks; x takes 2 before y can
    assert grows.table("x") == [1, 2] and grows.table("y") == [3, 4]


# -- random operation sequences ----------------------------------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "grow", "fork", "commit", "crop", "free", "window", "reserve"]),
        st.integers(0, 5),
        st.integers(0, 9),
        st.integers(1, 7),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.booleans())
def test_invariants_under_random_operations(ops, windowed):
    """After every operation: each pool's refcounts equal the number of table entries naming the block (no leak,
    no double free); free and live blocks are disjoint; a block two sequences share is never the target of a write
    without a copy first (no alias); a hashed block is never written."""
    groups = [None, 5] if windowed else [None]
    kv = KVManager(block_size=3, num_blocks=12, groups=groups)
    lengths, tokens = {}, {}
    for op, seq, token, count in ops:
        present = seq in kv.sequences
        if op == "add" and not present:
            kv.add(seq)
            prompt = [token] * 4 + list(range(count))
            hits = kv.cached_prefix_blocks(prompt)
            lengths[seq], tokens[seq] = kv.attach_prefix(seq, hits), prompt
        elif op == "grow" and present:
            start, end = lengths[seq], lengths[seq] + count
            before = {g: list(kv.table(seq, g)) for g in groups}
            if windowed:
                kv.free_out_of_window(seq, start)
            try:
                kv.allocate(seq, start, end)
            except CacheFullError:
                assert all(kv.table(seq, g) == before[g] or windowed for g in groups)
                continue
            copies = kv.take_copies()
            for g in groups:  # the block holding `start` is private and unhashed now: writing it is safe
                table = kv.table(seq, g)
                block = table[start // 3]
                if block != NULL_BLOCK:
                    assert kv.pools[g].refcount(block) == 1 and kv.pools[g]._hash_of.get(block) is None, copies
            lengths[seq] = end
            tokens[seq] = (tokens[seq] + [token] * end)[: max(end, len(tokens[seq]))]
        elif op == "commit" and present:
            kv.commit(seq, tokens[seq][: lengths[seq]])
        elif op == "fork" and present and count not in kv.sequences:
            kv.fork(seq, count)
            lengths[count], tokens[count] = lengths[seq], list(tokens[seq])
        elif op == "crop" and present:
            lengths[seq] = min(lengths[seq], token)
            kv.crop(seq, lengths[seq])
        elif op == "free" and present:
            kv.free(seq)
        elif op == "reserve" and present and not any(len(kv.table(seq, g)) for g in groups):
            kv.reserve_runs([seq], count)  # placement only: later grows take the wanted blocks while free
        elif op == "window" and present and windowed:
            kv.free_out_of_window(seq, lengths[seq])
        _check(kv)
    for seq in list(kv.sequences):
        kv.free(seq)
    _check(kv)
    assert kv.num_live_blocks() == 0  # nothing leaked


def _check(kv: KVManager) -> None:
    for g, pool in kv.pools.items():
        counts = {}
        for seq in kv.sequences.values():
            for block in seq.tables[g]:
                if block != NULL_BLOCK:
                    counts[block] = counts.get(block, 0) + 1
        for block in range(1, pool.num_blocks):
            assert pool.refcount(block) == counts.get(block, 0), (g, block)
        free = set(pool._free)
        assert len(free) == len(pool._free) and not free & set(counts) and not free & set(pool._evictable)
        assert pool.num_live() == len(counts)
