"""AttentionMetadata: what one forward's attention needs to read and write the paged KV, built once per forward;
and the forward context that carries it to every layer.

A forward runs B sequences' new tokens packed into one row of T tokens (sequence b's are rows
query_start_loc[b]:query_start_loc[b+1]); its T_b new tokens are the last T_b of its seq_lens[b] positions.
Each group of layers (full attention: None; sliding window w: w) has its own block tables and write slots.

The context is a contextvar, so it belongs to the thread (or task) running the forward: a server thread stepping
the engine does not change what another thread's plain forward of the same model does. While a context is set,
every attention lookup of transformers returns the paged backend (attention/backend.py); nothing on the model or
its config is changed.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

PAGED_ATTENTION = "paged_kv"  # the name the one paged attention backend (attention/backend.py) is registered under
_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("hf_attn_forward", default=None)


@dataclass
class AttentionMetadata:
    block_tables: dict  # group -> [B, max_blocks] long: block ids (NULL_BLOCK past a sequence's blocks)
    seq_lens: torch.Tensor  # [B] long: positions of each sequence after this forward (context + new)
    query_start_loc: torch.Tensor  # [B + 1] long: cumulative new-token counts
    slot_mapping: dict  # group -> [T] long: where each new token's K/V is written
    block_size: int
    layer_groups: tuple  # per layer: its group (None / window), or "state" for constant-state layers
    max_query_len: int  # host-side copies: no device sync in the layers
    max_seq_len: int
    query_lens: list[int] = field(default_factory=list)  # host-side [B]
    seq_lens_host: list[int] = field(default_factory=list)  # host-side [B]
    _derived: dict = field(default_factory=dict, repr=False)  # per-forward values computed by the first layer

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    def derived(self, key, build):
        """A value computed once per forward (by the first layer needing it) and shared by all layers."""
        value = self._derived.get(key)
        if value is None:
            value = self._derived[key] = build()
        return value


@dataclass
class ForwardContext:
    """route=True (the engine): every attention lookup returns the paged backend, which writes the new K/V.
    route=False (PagedKVCache under "paged_kv"): the cache wrote them; the backend reads the pages by block table
    where update() returned the storage itself, and `gather(layer)` gives K/V tensors for the reference path."""

    metadata: AttentionMetadata
    storage: list  # per layer: its KVStorage (kv_storage.py; None until the layer first writes)
    num_blocks: dict  # group -> blocks in its pool (the storage's first dimension)
    route: bool = True
    gather: object = None  # layer -> (K [B, H, L, d_k], V [B, H, L, d_v]); route=False only
    last_layer: int | None = None  # route=False: the context ends after this layer's attention
    states: list | None = None  # hybrid models in the engine: per sequence (query_start_loc order) its state Cache
    specs: list | None = None  # per layer its CacheSpec (variants.py): the storage layout a first write makes


def use_kernels(query: torch.Tensor) -> bool:
    """The kernel gate of every paged path: kernels run on CUDA; the CPU keeps the torch reference bit for bit
    (tests swap this to reach the kernel calls on CPU)."""
    return query.is_cuda


def get_forward_context() -> ForwardContext | None:
    return _CONTEXT.get()


def set_forward_context(context: ForwardContext | None) -> None:
    """Set (or clear, with None) the context without a block: PagedKVCache's forward has no enclosing call, so
    it sets one at its first layer and the backend clears it after `context.last_layer`."""
    _CONTEXT.set(context)


@contextlib.contextmanager
def forward_context(context: ForwardContext):
    """Set the context for the forward run inside the block (this thread only)."""
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


def build_metadata(
    tables: list[dict], starts: list[int], counts: list[int], block_size: int, layer_groups, device
) -> AttentionMetadata:
    """Sequences' block tables ({group: [block ids]}), first new position and new-token count -> metadata."""
    groups = list(tables[0]) if tables else []
    seq_lens = [s + n for s, n in zip(starts, counts)]
    block_tables, slot_mapping = {}, {}
    for g in groups:
        width = max(len(t[g]) for t in tables)
        padded = torch.zeros((len(tables), max(width, 1)), dtype=torch.long)
        for b, t in enumerate(tables):
            padded[b, : len(t[g])] = torch.tensor(t[g], dtype=torch.long)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        rows = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(counts))
        slot_mapping[g] = (padded[rows, positions // block_size] * block_size + positions % block_size).to(device)
        block_tables[g] = padded.to(device)
    loc = torch.zeros(len(counts) + 1, dtype=torch.long)
    loc[1:] = torch.tensor(counts, dtype=torch.long).cumsum(0)
    return AttentionMetadata(
        block_tables,
        torch.tensor(seq_lens, dtype=torch.long, device=device),
        loc.to(device),
        slot_mapping,
        block_size,
        tuple(layer_groups),
        max(counts, default=0),
        max(seq_lens, default=0),
        list(counts),
        seq_lens,
    )
