"""The registered attention function "paged_kv": attention that reads K/V from the paged storage itself.

With `model.set_attn_implementation("paged_kv")` and a PagedKVCache, the cache's update() returns *handles*
instead of gathered K/V: views of the layer's whole block storage, carrying the step's slot table. The attention
function resolves them. On CPU that is the pure-torch reference (gather by slot table, then SDPA). For a one-token
decode step on CUDA it calls `hf_attn_patch.kernels.paged_decode_attention` (backend "auto": Triton's paged decode
kernel where triton imports, else the torch twin) on the storage and the slot table, with no gather. Any module that
needs the tensors themselves (our MLA's absorbed path) calls `gather_paged` first.
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
    """query [B, H_q, T, d_k] -> ([B, T, H_q, d_v], None), as sdpa_attention_forward returns.

    A one-token decode step on CUDA whose call the kernel supports goes to the paged-decode kernel; everything
    else (CPU, prefill, plain tensors) is the reference: gather K/V by the slot table, then SDPA (GQA-aware
    through module.num_key_value_groups)."""
    if _decode_kernel_applies(query, key, attention_mask, kwargs):
        return _decode_with_kernel(query, key, attention_mask, kwargs.get("scaling")), None
    key, value = gather_paged(key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_decode_kernel(query: torch.Tensor) -> bool:
    """The kernel path (here and in our MLA module) is for CUDA; CPU keeps the reference bit for bit (tests swap
    this to reach the path)."""
    return query.is_cuda


def kernel_mask_ok(attention_mask, length: int) -> bool:
    """Whether a decode kernel can take this mask: None, or sdpa_mask's bool [B or 1, 1, 1, >= L] (True: attend)."""
    return attention_mask is None or (
        attention_mask.dtype == torch.bool and attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1)
        and attention_mask.shape[-1] >= length
    )  # fmt: skip


def kernel_decode_tables(handle, attention_mask, batch: int):
    """A decode kernel's view of a paged handle: (slots [B or 1, L], context_lens [B] int32, key_mask [B, L] or None).

    Our handles carry a per-token slot table (read_slots [B, L]): it is the block table of block_size 1, exact for
    every row (left-padded rows are not block-aligned in logical positions, and padding points at the null block's
    slot 0, so a block_size > 1 table cannot be derived from it in general). Every row has the same logical length
    L; left padding is hidden by the mask's key_mask, exactly as SDPA hides it.
    """
    length, device = handle.paged_length, handle.paged_storage.device
    slots = handle.paged_read_slots
    if slots is None:  # one row in consecutive slots from paged_contiguous_from
        first = handle.paged_contiguous_from
        slots = torch.arange(first, first + length, device=device).unsqueeze(0)
    context_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    key_mask = None if attention_mask is None else attention_mask[:, 0, 0, :length].expand(batch, length)
    return slots, context_lens, key_mask


# Keyword arguments the kernel does not implement: with any of them set, the reference path runs (and SDPA
# raises for softcap as it always did). sliding_window needs nothing: sdpa_mask already put it into the mask.
_REFERENCE_ONLY_KWARGS = ("softcap", "position_bias", "s_aux", "sinks", "head_mask", "output_attentions")


def _decode_kernel_applies(query, key, attention_mask, kwargs) -> bool:
    if not (is_paged_handle(key) and query.dim() == 4 and query.shape[2] == 1 and use_decode_kernel(query)):
        return False
    if kwargs.get("dropout") or any(kwargs.get(name) for name in _REFERENCE_ONLY_KWARGS):
        return False
    if query.dtype != key.paged_storage.dtype:
        return False
    return kernel_mask_ok(attention_mask, key.paged_length)  # anything else: reference


def _decode_with_kernel(query, key, attention_mask, scaling):
    """One decode token through the paged-decode kernel: query [B, H_q, 1, d_k] -> [B, 1, H_q, d_v]."""
    from hf_attn_patch.kernels import paged_decode_attention  # lazy: the kernels package is not needed on CPU

    storage, key_dim = key.paged_storage, key.paged_key_dim
    slots, context_lens, key_mask = kernel_decode_tables(key, attention_mask, query.shape[0])
    out = paged_decode_attention(
        query[:, :, 0], storage[..., :key_dim], storage[..., key_dim:], slots, context_lens, block_size=1,
        scale=scaling, key_mask=key_mask, validate=False,  # the cache built the slots: skip the device sync
    )  # fmt: skip
    return out.unsqueeze(1)
