"""KVStorage: every read (strided views, whole pages, slot by slot) equals the dense K/V written, in all three
layouts; PagedKVCache takes the view path for rows laid out side by side."""

from __future__ import annotations

import pytest
import torch

from hf_attn_patch import PagedKVCache
from hf_attn_patch.cache.kv_storage import KVStorage
from hf_attn_patch.compat import cache_kwarg, get_cache

from .conftest import tiny_model
from .test_paged_cache import generate_both, no_room_for_runs, ragged

LAYOUTS = [(4, 8, 8, False), (2, 8, 6, False), (1, 12, 4, True)]  # paired (d_k == d_v), split, fused (MLA)


def filled(heads, dk, dv, fused, num_blocks=9, block_size=4, seed=0):
    """A storage with random K/V at every slot, and the dense [H, slots, d] tensors written."""
    torch.manual_seed(seed)
    storage = KVStorage(num_blocks, block_size, heads, dk, dv, torch.empty(0), fused=fused)
    slots = num_blocks * block_size
    keys, values = torch.randn(heads, slots, dk), torch.randn(heads, slots, dv)
    order = torch.randperm(slots)  # written in a scrambled order: the slot index decides where a row goes
    storage.write(order, keys[:, order], values[:, order])
    return storage, keys, values


@pytest.mark.parametrize("heads,dk,dv,fused", LAYOUTS)
def test_reads_equal_the_dense_tensors(heads, dk, dv, fused):
    storage, keys, values = filled(heads, dk, dv, fused)
    bs = storage.block_size
    assert storage.paired == (not fused and dk == dv)
    k, v = storage.strided(5, 0, 1, 11)  # one row: slots 5..15
    assert torch.equal(k[0], keys[:, 5:16]) and torch.equal(v[0], values[:, 5:16])
    k, v = storage.strided(2, 13, 2, 11)  # two rows at a stride of 13 slots: 2..12 and 15..25
    assert k.shape == (2, heads, 11, dk) and v.shape == (2, heads, 11, dv)
    for r in range(2):
        row = slice(2 + 13 * r, 13 + 13 * r)
        assert torch.equal(k[r], keys[:, row]) and torch.equal(v[r], values[:, row])
    k[1, :, 10] = 7.0  # a view: writing it writes slot 25 of the storage, and nothing else
    keys[:, 25] = 7.0
    assert torch.equal(storage.keys, keys) and torch.equal(storage.values, values)
    new_k, new_v = torch.randn(2, heads, 3, dk), torch.randn(2, heads, 3, dv)
    k, v = storage.append_strided(2, 13, 11, new_k, new_v)  # positions 11..13 of both rows, then all 14
    keys[:, [13, 14, 15, 26, 27, 28]] = new_k.transpose(0, 1).reshape(heads, 6, dk)
    values[:, [13, 14, 15, 26, 27, 28]] = new_v.transpose(0, 1).reshape(heads, 6, dv)
    assert torch.equal(storage.keys, keys) and torch.equal(storage.values, values)
    assert torch.equal(k[1], keys[:, 15:29]) and torch.equal(v[0], values[:, 2:16])
    blocks = torch.tensor([[3, 1, 7], [2, 8, 0]])  # two rows' pages
    length = 10
    slots = (blocks[:, :, None] * bs + torch.arange(bs)).reshape(2, -1)[:, :length]
    want_k, want_v = keys[:, slots].transpose(0, 1), values[:, slots].transpose(0, 1)  # [B, H, L, d]
    k, v = storage.read_pages(storage.page_index(blocks), 2, length)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert k.shape == (2, heads, length, dk) and k[0, 0].is_contiguous() == (not fused)
    k, v = storage.read_slots(storage.slot_index(slots.reshape(-1)), 2, length)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    # the kernels' flat views [slots, H, d]
    assert torch.equal(storage.key_cache, keys.transpose(0, 1))
    assert torch.equal(storage.value_cache, values.transpose(0, 1))


@pytest.mark.parametrize("heads,dk,dv,fused", LAYOUTS)
def test_copy_grow_and_zero_blocks(heads, dk, dv, fused):
    storage, keys, values = filled(heads, dk, dv, fused)
    bs = storage.block_size
    storage.copy_block(2, 5)
    assert torch.equal(storage.keys[:, 5 * bs : 6 * bs], keys[:, 2 * bs : 3 * bs])
    assert torch.equal(storage.values[:, 5 * bs : 6 * bs], values[:, 2 * bs : 3 * bs])
    storage.grow(12)
    assert storage.num_blocks == 12 and torch.equal(storage.keys[:, : 2 * bs], keys[:, : 2 * bs])
    assert storage.block_is_zero(10) and not storage.block_is_zero(1)
    storage.zero_block(1)
    assert storage.block_is_zero(1) and storage.any()
    if fused:
        assert storage.rows.shape == (12 * bs, 1, dk + dv)  # [c | k_rope] per token: the MLA decode kernel's rows


def test_block_aligned_padding_reads_whole_pages_and_matches():
    """Rows not laid out (no room for the runs) with left padding of whole blocks (8, 4, 0 at block_size 4) read
    whole pages; the output is DynamicCache's."""
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(5, 9, 13))
    reference, paged, cache = generate_both(
        model, ids, mask, block_size=4, cache_kwargs=no_room_for_runs(mask, 12), max_new_tokens=12, do_sample=False
    )
    assert torch.equal(reference, paged)
    assert cache.slots.pages[None] is not None  # the last step read whole pages


def test_unaligned_padding_reads_slot_by_slot_and_matches():
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(9, 4, 13))  # pads 4, 9, 0: row 2's pages would start mid-block
    reference, paged, cache = generate_both(
        model, ids, mask, block_size=4, cache_kwargs=no_room_for_runs(mask, 12), max_new_tokens=12, do_sample=False
    )
    assert torch.equal(reference, paged)
    assert cache.slots.pages[None] is None and isinstance(cache, PagedKVCache)


def test_unpadded_batch_is_laid_out_and_read_as_one_view():
    """generate() passes its max_length: an unpadded batch's rows get side-by-side runs, every step (block
    boundaries included) writes and reads them as strided views, and the output is DynamicCache's."""
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(7, 7, 7))
    views = []
    original = KVStorage.append_strided

    def counting(self, *args):
        views.append(args[:3])
        return original(self, *args)

    KVStorage.append_strided = counting
    try:
        reference, paged, cache = generate_both(model, ids, mask, block_size=4, max_new_tokens=12, do_sample=False)
    finally:
        KVStorage.append_strided = original
    assert torch.equal(reference, paged)
    first, stride = cache.slots.strided[None]
    assert stride == 5 * 4  # max_length 19 -> 5 blocks per row
    tables = [cache.manager.table(row.id) for row in cache.rows]
    assert tables == [list(range(first // 4 + 5 * r, first // 4 + 5 * r + 5)) for r in range(3)]
    steps = 12  # the prefill and 11 decode steps, every layer of each read through the view
    assert len(views) == steps * model.config.num_hidden_layers and not cache.slots.read
    out = model.generate(
        ids,
        attention_mask=mask,
        pad_token_id=0,
        max_new_tokens=12,
        do_sample=False,
        cache_implementation="paged_kv",
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, reference) and get_cache(out).slots.strided[None] is not None


def test_padded_batch_is_laid_out_storing_the_padding_of_its_first_block():
    """Pads 4, 9, 0 at block size 4: each run starts with its row's whole padding blocks (unallocated: row 1's 2),
    the row's partial padding is stored (row 1's position 8, masked), and every step reads the views."""
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(9, 4, 13))
    reference, paged, cache = generate_both(model, ids, mask, block_size=4, max_new_tokens=12, do_sample=False)
    assert torch.equal(reference, paged)
    first, stride = cache.slots.strided[None]
    assert [row.pad for row in cache.rows] == [4, 8, 0] and stride == 7 * 4  # max_length 25
    held = 13 + 12 - 1  # positions written: the prompt and every generated token but the last
    for r, row in enumerate(cache.rows):
        home = first // 4 + 7 * r + row.pad // 4
        assert cache.manager.table(row.id) == list(range(home, home + -(-(held - row.pad) // 4)))
    assert cache.stats()["used_bytes"] == (3 * held - 4 - 8) * sum(cache.values_per_token) * 4  # fp32


def test_without_max_length_a_batch_falls_back_to_page_reads():
    """Rows prefilled side by side without a reservation outgrow their runs at the first new block."""
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(8, 8))
    cache = PagedKVCache(model.config, block_size=4)
    cache.start_request(ids, mask)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **cache_kwarg(cache)).logits
        assert cache.slots.strided[None] == (4, 8)  # blocks 1-2 and 3-4: one view at a stride of 2 blocks
        token = logits[:, -1:].argmax(-1)
        mask = torch.cat((mask, mask.new_ones(2, 1)), 1)
        model(token, attention_mask=mask, **cache_kwarg(cache))
    assert cache.slots.strided[None] is None and cache.slots.pages[None] is not None
    with pytest.raises(ValueError, match="max_length=5 must be an integer >= the prompt length 8"):
        cache.start_request(ids, mask[:, :8], max_length=5)
