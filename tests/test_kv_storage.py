"""KVStorage: every read (a run, whole pages, slot by slot) equals the dense K/V written, in all three layouts."""

from __future__ import annotations

import pytest
import torch

from hf_attn_patch import PagedKVCache
from hf_attn_patch.cache.kv_storage import KVStorage

from .conftest import tiny_model
from .test_paged_cache import generate_both, ragged

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
    k, v = storage.run(5, 11)
    assert torch.equal(k[0], keys[:, 5:16]) and torch.equal(v[0], values[:, 5:16])
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
    """Left padding of whole blocks (8, 4, 0 at block_size 4) keeps the page gather; the output is DynamicCache's."""
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(5, 9, 13))
    reference, paged, cache = generate_both(model, ids, mask, block_size=4, max_new_tokens=12, do_sample=False)
    assert torch.equal(reference, paged)
    assert cache._pages[None] is not None  # the last step read whole pages


def test_unaligned_padding_reads_slot_by_slot_and_matches():
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(9, 4, 13))  # pads 4, 9, 0: row 2's pages would start mid-block
    reference, paged, cache = generate_both(model, ids, mask, block_size=4, max_new_tokens=12, do_sample=False)
    assert torch.equal(reference, paged)
    assert cache._pages[None] is None and isinstance(cache, PagedKVCache)
