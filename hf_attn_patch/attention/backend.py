"""The one paged attention backend: reads AttentionMetadata from the forward context, writes the new K/V into the
layer's block storage, and attends over the pages at block granularity.

Registered as "paged_kv" (AttentionInterface), and, while a routing forward context is set (cache/metadata.py),
returned by every attention lookup of transformers (`AttentionInterface.get_interface` is wrapped by `_patching.py`
with `interface_in_context`): the engine's runner sets the context around its one forward per step and never
touches the model's config. PagedKVCache under "paged_kv" sets a non-routing context for its decode steps on CUDA
(it wrote the K/V itself and hands attention the layer's storage): the decode kernels read it by block table.

Dispatch per layer call, query [B, H, T, d] (the engine: B = 1, T packed tokens of many sequences):
- CUDA (`use_kernels`), all new tokens single (decode): kernels.paged_decode_attention / kernels.mla_decode;
- CUDA, otherwise: kernels.paged_prefill_attention (varlen, causal, bottom-right aligned);
- CPU: the torch reference here (gather + SDPA per segment; decodes batched in groups of similar length).
Each takes block tables [B, max_blocks] and seq_lens [B]; the null block (id 0) is zeros and masked.
Sliding windows: query at position q sees keys (q - window, q], as transformers' sliding_window_overlay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from ..cache import metadata
from ..cache.kv_storage import KVStorage
from ..cache.metadata import (
    PAGED_ATTENTION,
    AttentionMetadata,
    ForwardContext,
    get_forward_context,
    set_forward_context,
)

__all__ = [
    "PAGED_ATTENTION",
    "finish_layer",
    "interface_in_context",
    "paged_attention_forward",
    "read_segment",
    "segments",
    "write_new",
]
DECODE_GROUP = 16  # decodes per batched CPU attention call: sorted by context length, padded to the group's longest
# Keyword arguments the decode kernels do not take: with any set, the reference runs (sliding_window needs none:
# the window is the layer's group; SDPA raises for softcap as it always did).
_REFERENCE_ONLY_KWARGS = ("softcap", "position_bias", "s_aux", "sinks", "head_mask", "output_attentions")


def interface_in_context(get_interface):
    """Wrap AttentionInterface.get_interface: inside a routing forward context every lookup returns the backend."""

    def lookup(self, attn_implementation, default):
        context = get_forward_context()
        if context is not None and context.route:
            return paged_attention_forward
        return get_interface(self, attn_implementation, default)

    lookup.__wrapped__ = get_interface
    lookup.routes_forward_context = True
    return lookup


def lookups_routed() -> bool:
    """Whether transformers' attention lookup is the wrapper above (installed by patch(), removed by unpatch())."""
    return getattr(AttentionInterface.get_interface, "routes_forward_context", False)


# -- storage ------------------------------------------------------------------------------------------------------


def layer_storage(context: ForwardContext, layer: int, key: torch.Tensor, value: torch.Tensor) -> KVStorage:
    """The layer's KVStorage (made, zeroed, at its first write, in the layout of the layer's CacheSpec)."""
    storage = context.storage[layer]
    if storage is None:
        group = context.metadata.layer_groups[layer]
        storage = context.storage[layer] = KVStorage(
            context.num_blocks[group],
            context.metadata.block_size,
            key.shape[1],
            key.shape[-1],
            value.shape[-1],
            key,
            fused=context.specs[layer].fused,
        )
    return storage


def write_new(context: ForwardContext, layer: int, key: torch.Tensor, value: torch.Tensor) -> KVStorage:
    """Write the new tokens' key [1, H_kv, T, d_k], value [1, H_kv, T, d_v] at the step's slots -> the storage."""
    storage = layer_storage(context, layer, key, value)
    storage.write(context.metadata.slot_mapping[context.metadata.layer_groups[layer]], key[0], value[0])
    return storage


# -- the registered function --------------------------------------------------------------------------------------


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, H, T, d_k] -> ([B, T, H, d_v], None), as sdpa_attention_forward returns.

    Without a forward context (a model set to "paged_kv" called with ordinary K/V tensors) this is SDPA."""
    context = get_forward_context()
    if context is not None and not context.route:  # PagedKVCache's decode step
        return _cache_decode(module, query, key, value, attention_mask, scaling, dropout, context, kwargs)
    if context is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout:
        raise ValueError(f"paged attention has no dropout (got dropout={dropout}); call model.eval()")
    layer, meta = module.layer_idx, context.metadata
    storage = write_new(context, layer, key, value)
    window = kwargs.get("sliding_window") or None
    softcap = kwargs.get("softcap") or None
    group = meta.layer_groups[layer]
    q = query[0].transpose(0, 1)  # [T, H, d_k]
    if metadata.use_kernels(query):
        out = _kernel_attention(q, storage.key_cache, storage.value_cache, meta, group, scaling, window, softcap)
    else:
        out = _reference_attention(q, storage, meta, group, scaling, window, softcap)
    return out[None], None


def reads_pages(context: ForwardContext | None, layer: int, key: torch.Tensor) -> bool:
    """Whether `key` is a view of the context's storage of `layer` (PagedKVCache handed attention its pages)."""
    storage = None if context is None or context.route else context.storage[layer]
    return storage is not None and key.untyped_storage().data_ptr() == storage.keys.untyped_storage().data_ptr()


def finish_layer(context: ForwardContext, layer: int) -> None:
    """A PagedKVCache context ends after its last paged layer (no call encloses a generate() forward)."""
    if not context.route and layer == context.last_layer:
        set_forward_context(None)


def _cache_decode(module, query, key, value, attention_mask, scaling, dropout, context, kwargs):
    """One decode token per row over PagedKVCache's pages: the kernel by block table where it applies, else
    gathered K/V and SDPA. query [B, H, 1, d_k] -> ([B, 1, H, d_v], None)."""
    layer = module.layer_idx
    try:
        if not reads_pages(context, layer, key):  # stale context: ordinary tensors
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        meta, storage = context.metadata, context.storage[layer]
        group = meta.layer_groups[layer]
        kernel = not dropout and not any(kwargs.get(name) for name in _REFERENCE_ONLY_KWARGS)
        if kernel and query.dtype == storage.dtype:
            window = group if isinstance(group, int) else None
            out = _kernel_attention(
                query[:, :, 0], storage.key_cache, storage.value_cache, meta, group, scaling, window, None
            )
            return out.unsqueeze(1), None
        key, value = context.gather(layer)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    finally:
        finish_layer(context, layer)


def _kernel_attention(q, key_cache, value_cache, meta: AttentionMetadata, group, scale, window, softcap):
    from hf_attn_patch.kernels.ops import paged_decode_attention, paged_prefill_attention

    tables = meta.block_tables[group]
    options = dict(block_size=meta.block_size, scale=scale, softcap=softcap, sliding_window=window, validate=False)
    if meta.is_decode:  # one query per sequence: q [B, H, d_k]
        return paged_decode_attention(q, key_cache, value_cache, tables, meta.seq_lens, **options)
    return paged_prefill_attention(q, key_cache, value_cache, tables, meta.query_start_loc, meta.seq_lens, **options)


# -- the torch reference (CPU) ------------------------------------------------------------------------------------


def segments(meta: AttentionMetadata, group, window):
    """Per forward and group (built by the first layer, shared by the rest): [(queries, blocks, visible)] where
    queries selects rows of the packed [T] queries (a [g] index tensor of decodes, or a slice of one chunk),
    blocks [g, n] the context's pages (g = 1 for a chunk) and visible [g, 1, q, L] bool (L <= n * block_size)."""

    def build():
        tables, bs = meta.block_tables[group], meta.block_size
        device = tables.device
        out, decodes = [], []
        for b, (n, length) in enumerate(zip(meta.query_lens, meta.seq_lens_host)):
            start = int(meta.query_start_loc[b]) if n else 0
            if n == 1:
                decodes.append((start, b, length))
            elif n > 1:
                positions = torch.arange(length, device=device)
                query_pos = positions[length - n :, None]
                visible = positions[None, :] <= query_pos
                if window is not None:
                    visible = visible & (positions[None, :] > query_pos - window)
                out.append((slice(start, start + n), tables[b : b + 1, : -(-length // bs)], visible[None, None]))
        decodes.sort(key=lambda item: item[2])
        for i in range(0, len(decodes), DECODE_GROUP):
            chunk = decodes[i : i + DECODE_GROUP]
            longest = chunk[-1][2]
            positions = torch.arange(longest, device=device)
            rows = torch.tensor([b for _, b, _ in chunk], device=device)
            lengths = torch.tensor([n for _, _, n in chunk], device=device)
            visible = positions[None, :] < lengths[:, None]
            if window is not None:
                visible = visible & (positions[None, :] > lengths[:, None] - 1 - window)
            index = torch.tensor([t for t, _, _ in chunk], dtype=torch.long, device=device)
            out.append((index, tables[rows, : -(-longest // bs)], visible[:, None, None, :]))
        return out

    return meta.derived(("segments", group, window), build)


def read_segment(storage: KVStorage, meta: AttentionMetadata, segment: tuple, blocks: torch.Tensor, length: int):
    """A segment's K [g, H_kv, L, d_k], V [g, H_kv, L, d_v]: one gather of whole pages per head (the page index
    is made once per forward for the segment, (group, window, i), and layers of this many heads and blocks)."""
    index = meta.derived(("pages", *segment, storage.heads, storage.num_blocks), lambda: storage.page_index(blocks))
    return storage.read_pages(index, blocks.shape[0], length)


def _reference_attention(q, storage: KVStorage, meta, group, scale, window, softcap):
    """q [T, H, d_k] over the layer's storage -> [T, H, d_v]: gather + SDPA per segment."""
    if softcap is not None:
        raise ValueError(f"softcap={softcap}: the CPU paged reference does not implement it")
    out = q.new_empty((q.shape[0], q.shape[1], storage.value_dim))
    dk = storage.key_dim
    for i, (selector, blocks, visible) in enumerate(segments(meta, group, window)):
        k, v = read_segment(storage, meta, (group, window, i), blocks, visible.shape[-1])  # [b, H_kv, L, d]
        k, v = k.to(q.dtype), v.to(q.dtype)
        if isinstance(selector, slice):
            queries = q[selector].transpose(0, 1)[None]  # [1, H, n, d_k]
            o = F.scaled_dot_product_attention(
                queries, k, v, attn_mask=visible, scale=scale, enable_gqa=k.shape[1] != queries.shape[1]
            )
            out[selector] = o[0].transpose(0, 1)  # [n, H, d_v]
        else:
            queries = q[selector][:, :, None]  # [g, H, 1, d_k]
            # Decodes: the n_rep query heads of each KV head (heads j*n_rep .. (j+1)*n_rep - 1, repeat_kv's order)
            # go in as n_rep queries of that head; the mask [g, 1, 1, L] is the same for all of them. On CPU this
            # is about 2x faster than enable_gqa (which expands K/V), the same packing transformers' SDPA uses.
            g, heads, kv_heads = queries.shape[0], queries.shape[1], k.shape[1]
            packed = queries.reshape(g, kv_heads, heads // kv_heads, dk)
            o = F.scaled_dot_product_attention(packed, k, v, attn_mask=visible, scale=scale)
            out[selector] = o.reshape(g, heads, -1)
    return out
