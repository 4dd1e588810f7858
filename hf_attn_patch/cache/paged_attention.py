"""The registered attention function "paged_kv": attention that reads K/V from the paged storage itself.

With `model.set_attn_implementation("paged_kv")` and a PagedKVCache, the cache's update() returns *handles*
instead of gathered K/V: views of the layer's whole block storage, carrying the step's slot table. The attention
function resolves them. Here that is the pure-torch reference (gather by slot table, then SDPA): the CPU path and
the oracle that GPU kernels (Triton, flash-attn's block_table decode) are checked against when they plug in here.
Any module that needs the tensors themselves (our MLA's absorbed path) calls `gather_paged` first.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PAGED_ATTENTION = "paged_kv"


def paged_handles(storage, key_dim: int, read_slots, contiguous_from: int | None, length: int):
    """(key, value) handles for one layer: storage [slots, H, d_k + d_v] viewed whole, plus how to read it:
    slot table read_slots [B, length], or (one row stored consecutively) slots contiguous_from + [0, length)."""
    handles = []
    for part in (slice(None, key_dim), slice(key_dim, None)):
        handle = storage[:, :, part]  # a view: nothing is copied here
        handle.paged_storage, handle.paged_key_dim, handle.paged_length = storage, key_dim, length
        handle.paged_read_slots, handle.paged_contiguous_from = read_slots, contiguous_from
        handles.append(handle)
    return tuple(handles)


def is_paged_handle(tensor) -> bool:
    return getattr(tensor, "paged_storage", None) is not None


def gather_paged(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Handles -> K [B, H, L, d_k], V [B, H, L, d_v] (a view for one contiguous row, else a gather); tensors pass."""
    if not is_paged_handle(key):
        return key, value
    return read_paged(key.paged_storage, key.paged_key_dim, key.paged_read_slots, key.paged_contiguous_from,
                      key.paged_length)  # fmt: skip


def read_paged(storage, key_dim: int, read_slots, contiguous_from: int | None, length: int):
    """K [B, H, L, d_k], V [B, H, L, d_v] from storage [slots, H, d_k + d_v]: a view for one contiguous row,
    else one gather of keys and values together (they sit side by side)."""
    if contiguous_from is not None:
        both = storage[contiguous_from : contiguous_from + length].unsqueeze(0)
    else:
        both = storage.index_select(0, read_slots.reshape(-1)).view(*read_slots.shape, *storage.shape[1:])
    both = both.transpose(1, 2)
    return both[..., :key_dim], both[..., key_dim:]


def paged_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """Reference: gather K/V by the slot table, then SDPA (GQA-aware through module.num_key_value_groups)."""
    key, value = gather_paged(key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
