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
from ..cache.metadata import (PAGED_ATTENTION, AttentionMetadata, ForwardContext, get_forward_context,
                              set_forward_context)  # fmt: skip

__all__ = ["PAGED_ATTENTION", "interface_in_context", "latent_kv_attention", "mla_attention", "paged_attention_forward"]
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
    """The layer's KVStorage (made, zeroed, at its first write; H = 1, MLA's latent and RoPE key, fused)."""
    storage = context.storage[layer]
    if storage is None:
        group = context.metadata.layer_groups[layer]
        storage = context.storage[layer] = KVStorage(context.num_blocks[group], context.metadata.block_size,
                                                     key.shape[1], key.shape[-1], value.shape[-1], key,
                                                     fused=key.shape[1] == 1)  # fmt: skip
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
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # fmt: skip
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
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)  # fmt: skip
        meta, storage = context.metadata, context.storage[layer]
        group = meta.layer_groups[layer]
        kernel = not dropout and not any(kwargs.get(name) for name in _REFERENCE_ONLY_KWARGS)
        if kernel and query.dtype == storage.dtype:
            window = group if isinstance(group, int) else None
            out = _kernel_attention(query[:, :, 0], storage.key_cache, storage.value_cache, meta, group, scaling,
                                    window, None)  # fmt: skip
            return out.unsqueeze(1), None
        key, value = context.gather(layer)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # fmt: skip
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
            o = F.scaled_dot_product_attention(queries, k, v, attn_mask=visible, scale=scale,
                                               enable_gqa=k.shape[1] != queries.shape[1])  # fmt: skip
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


# -- MLA ----------------------------------------------------------------------------------------------------------


def mla_attention(module, q_nope, q_rope, latent, k_rope, context: ForwardContext) -> torch.Tensor:
    """MLA over latent pages: q [1, H, T, *], new latent [1, 1, T, d_c], k_rope [1, 1, T, d_r] -> [1, T, H, d_v].

    The storage holds [c | k_rope] per token (H = 1). CUDA decode: kernels.mla_decode with block tables; otherwise
    the module's absorbed attention per segment (torch)."""
    meta, layer = context.metadata, module.layer_idx
    storage = write_new(context, layer, latent, k_rope)
    group = meta.layer_groups[layer]
    window = module.spec.sliding_window
    if metadata.use_kernels(q_nope) and meta.is_decode and window is None and module.qk_rope_head_dim:
        return mla_kernel_decode(module, q_nope[0].transpose(0, 1), q_rope[0].transpose(0, 1), storage.rows,
                                 meta)[None]  # fmt: skip
    out = q_nope.new_empty((q_nope.shape[2], q_nope.shape[1], module.v_head_dim))
    for i, (selector, blocks, visible) in enumerate(segments(meta, group, window)):  # the torch reference
        c, rope = read_segment(storage, meta, (group, window, i), blocks, visible.shape[-1])  # [b, 1, L, d_c / d_r]
        if isinstance(selector, slice):
            qn, qr = q_nope[:, :, selector], q_rope[:, :, selector]
        else:
            qn, qr = (x[0][:, selector].transpose(0, 1)[:, :, None] for x in (q_nope, q_rope))
        o, _ = module._absorbed(qn, qr, c.to(q_nope.dtype), rope.to(q_nope.dtype), visible)
        out[selector] = o[0] if isinstance(selector, slice) else o[:, 0]
    return out[None]


def latent_kv_attention(module, q, c_k, c_v, context: ForwardContext) -> torch.Tensor:
    """Latent K/V attention (attention/latent_kv.py) over latent pages: q [1, H, T, d_h] (before RoPE), the new
    c_k [1, 1, T, r_k], c_v [1, 1, T, r_v] -> [1, T, H, r_v]. The storage holds [c_k | c_v] per token (H = 1).
    Keys are rotated at their positions 0..L-1; a chunk's n queries sit at L-n..L-1 and a decode at its last
    visible position (decodes of a group are padded to the longest)."""
    meta, layer = context.metadata, module.layer_idx
    storage = write_new(context, layer, c_k, c_v)
    group, window = meta.layer_groups[layer], module.spec.sliding_window
    out = q.new_empty((q.shape[2], q.shape[1], module.value_rank))
    for i, (selector, blocks, visible) in enumerate(segments(meta, group, window)):
        length = visible.shape[-1]
        latent_k, latent_v = read_segment(storage, meta, (group, window, i), blocks, length)  # [b, 1, L, r]
        if isinstance(selector, slice):
            queries = q[:, :, selector]  # [1, H, n, d_h]
            positions = torch.arange(length - queries.shape[2], length, device=q.device)[None]
        else:
            queries = q[0][:, selector].transpose(0, 1)[:, :, None]  # [g, H, 1, d_h]
            positions = (length - 1 - visible[:, 0, 0].flip(-1).int().argmax(-1))[:, None]
        o, _ = module.attend(queries, latent_k.to(q.dtype), latent_v.to(q.dtype), visible, positions)
        out[selector] = o[0] if isinstance(selector, slice) else o[:, 0]
    return out[None]


def mla_kernel_decode(module, q_nope, q_rope, flat, meta: AttentionMetadata) -> torch.Tensor:
    """kernels.mla_decode by block table: q_nope [B, H, d_n], q_rope [B, H, d_r] (one token per sequence), flat
    latent pages [slots, 1, d_c + d_r] -> [B, H, d_v] (W_UK folded into the query, W_UV applied to the output)."""
    from hf_attn_patch.kernels.ops import mla_decode

    w_uk, w_uv = module._up_weights()
    q_latent = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    group = meta.layer_groups[module.layer_idx]
    out_latent = mla_decode(q_latent, q_rope, flat, meta.block_tables[group], meta.seq_lens,
                            block_size=meta.block_size, scale=module.scaling, validate=False)  # fmt: skip
    return torch.einsum("bhc,hvc->bhv", out_latent.to(q_nope.dtype), w_uv)


def mla_cache_decode(module, q_nope, q_rope, latent, context: ForwardContext):
    """MLA decode over PagedKVCache's pages (CUDA, no window): q [B, H, 1, *] -> [B, 1, H, d_v], or None when the
    module must run its own path on gathered tensors (`context.gather`)."""
    layer = module.layer_idx
    try:
        storage = context.storage[layer]
        if module.spec.sliding_window is not None or not module.qk_rope_head_dim or latent.dtype != q_nope.dtype:
            return None
        return mla_kernel_decode(module, q_nope[:, :, 0], q_rope[:, :, 0], storage.rows, context.metadata)[:, None]
    finally:
        finish_layer(context, layer)

