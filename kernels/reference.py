"""Pure-torch versions of every kernel op: the CPU path and the oracle the Triton / flash-attn backends are tested
against. Clarity over speed; math in fp32, results cast back to the query's (logits') dtype.

Paged layout (what PagedKVCache and the engine store: hf_attn_patch/cache/kv_storage.py). One layer's keys are
`[H, slots, d_k]` and values `[H, slots, d_v]`, head-major, with `slot = block * block_size + offset`. The ops take
K and V as flat strided views `[slots, H, d]` (slot stride d, head stride slots * d; only the last dim must be
contiguous):

    key_cache   [slots, H_kv, d_k]  (= keys.transpose(0, 1))     or 4-D [num_blocks, block_size, H_kv, d_k]
    value_cache [slots, H_kv, d_v]  (= values.transpose(0, 1))   or 4-D [num_blocks, block_size, H_kv, d_v]

Logical position p of row b lives in slot `block_tables[b, p // block_size] * block_size + p % block_size`.
A per-token slot table is the special case block_size = 1 (block_tables = slots).

MLA layers store `[1, slots, d_c + d_r]` = [c_kv | k_rope] per token, read as `[slots, 1, d_c + d_r]`
(d_c = kv_lora_rank, d_r = qk_rope_head_dim).
"""

from __future__ import annotations

import torch

__all__ = [
    "paged_decode_attention",
    "mla_decode",
    "paged_prefill_attention",
    "apply_token_bitmask",
    "flat_cache",
    "token_slots",
    "unpack_bitmask",
]


# -- shared helpers (also used by the dispatching entry points for validation) -------------------------------------


def flat_cache(cache: torch.Tensor, block_size: int | None, name: str) -> tuple[torch.Tensor, int]:
    """[num_blocks, block_size, H, d] or [slots, H, d] -> ([slots, H, d] view, block_size)."""
    if cache.dim() == 4:
        if block_size is not None and block_size != cache.shape[1]:
            raise ValueError(f"block_size={block_size} but {name} has blocks of {cache.shape[1]} tokens")
        return cache.flatten(0, 1), cache.shape[1]
    if cache.dim() != 3:
        raise ValueError(f"{name} must be [slots, H, d] or [num_blocks, block_size, H, d], got {tuple(cache.shape)}")
    if block_size is None or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: a positive integer is needed with a 3-D {name}")
    if cache.shape[0] % block_size:
        raise ValueError(f"{name} has {cache.shape[0]} slots, not a multiple of block_size={block_size}")
    return cache, block_size


def token_slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, length] slot ids of positions [0, length)."""
    pos = torch.arange(length, device=block_tables.device)
    return block_tables[:, pos // block_size].long() * block_size + pos % block_size


def _positions_valid(context_lens, length: int, key_mask, sliding_window, query_pos=None):
    """Keys a query may see: [B, L] (decode: query at context_len - 1) or [B, T, L] with query_pos [B, T]."""
    keys = torch.arange(length, device=context_lens.device)
    valid = keys[None, :] < context_lens[:, None]
    if key_mask is not None:
        valid = valid & key_mask[:, :length].bool()
    if query_pos is None:
        if sliding_window is not None:  # query at position ctx - 1 sees (ctx - 1 - window, ctx - 1]
            valid = valid & (keys[None, :] > context_lens[:, None] - 1 - sliding_window)
        return valid
    valid = valid[:, None, :] & (keys[None, None, :] <= query_pos[..., None])
    if sliding_window is not None:
        valid = valid & (keys[None, None, :] > query_pos[..., None] - sliding_window)
    return valid


def _softmax_out(scores, valid, values, softcap):
    """scores [..., L] fp32, valid [..., L] -> softmax(scores) @ values (fp32); all-masked rows give 0."""
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key: 0, not NaN
    return probs @ values


# -- paged decode ------------------------------------------------------------------------------------------------


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row over its paged K/V (GQA: query head h reads KV head h // (H_q / H_kv)).

    query [B, H_q, d_k]; key_cache [slots, H_kv, d_k]; value_cache [slots, H_kv, d_v] (or 4-D blocks);
    block_tables [B, max_blocks]; context_lens [B] (keys 0..ctx-1 are visible, the query sits at ctx - 1);
    key_mask [B, >= max ctx] bool (False: hidden key, e.g. left padding); returns [B, H_q, d_v] in query's dtype.
        out[b, h] = softmax_j(cap(scale * q[b, h] . k[b, j])) @ v[b, j],  cap(s) = softcap * tanh(s / softcap)
    """
    key_cache, block_size = flat_cache(key_cache, block_size, "key_cache")
    value_cache, _ = flat_cache(value_cache, block_size, "value_cache")
    batch, heads_q, d_k = query.shape
    heads_kv = key_cache.shape[1]
    group = heads_q // heads_kv
    scale = d_k**-0.5 if scale is None else scale
    length = int(context_lens.max()) if batch else 0
    slots = token_slots(block_tables, block_size, length)
    valid = _positions_valid(context_lens, length, key_mask, sliding_window)
    slots = torch.where(valid, slots, 0)  # entries past a row's end may hold anything: never index with them
    k = key_cache[slots].float().permute(0, 2, 3, 1)  # [B, H_kv, d_k, L]
    v = value_cache[slots].float().transpose(1, 2)  # [B, H_kv, L, d_v]
    q = query.float().view(batch, heads_kv, group, d_k)
    scores = (q @ k) * scale  # [B, H_kv, G, L]
    out = _softmax_out(scores, valid[:, None, None, :], v, softcap)  # [B, H_kv, G, d_v]
    return out.reshape(batch, heads_q, -1).to(query.dtype)


# -- MLA absorbed decode -----------------------------------------------------------------------------------------


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA decode in latent space (W_UK folded into q_latent, W_UV applied by the caller to the output).

    q_latent [B, H, d_c]; q_rope [B, H, d_r]; latent_cache [slots, 1, d_c + d_r] ([c | k_rope] per token) or 4-D
    [num_blocks, block_size, 1, d_c + d_r]; block_tables / context_lens / key_mask as in paged_decode_attention.
        score[b, h, j] = scale * (q_latent[b, h] . c[b, j] + q_rope[b, h] . k_rope[b, j])
        out[b, h] = softmax_j(score) @ c[b, j]        -> [B, H, d_c] in q_latent's dtype
    scale defaults to 1/sqrt(d_c + d_r); DeepSeek passes 1/sqrt(qk_nope_head_dim + qk_rope_head_dim).
    """
    latent_cache, block_size = flat_cache(latent_cache, block_size, "latent_cache")
    batch, heads, d_c = q_latent.shape
    d_r = q_rope.shape[-1]
    scale = (d_c + d_r) ** -0.5 if scale is None else scale
    length = int(context_lens.max()) if batch else 0
    slots = token_slots(block_tables, block_size, length)
    valid = _positions_valid(context_lens, length, key_mask, None)
    rows = latent_cache[torch.where(valid, slots, 0)][:, :, 0].float()  # [B, L, d_c + d_r]
    c, k_rope = rows[..., :d_c], rows[..., d_c:]
    scores = q_latent.float() @ c.transpose(1, 2) + q_rope.float() @ k_rope.transpose(1, 2)  # [B, H, L]
    out = _softmax_out(scores * scale, valid[:, None, :], c, None)
    return out.to(q_latent.dtype)


# -- varlen prefill over paged KV --------------------------------------------------------------------------------


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    causal: bool = True,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Packed queries of B sequences over their paged K/V (the new tokens' K/V already written to the pages).

    query [total_q, H_q, d_k] (sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b+1]);
    cu_seqlens_q [B + 1] int; context_lens [B]: keys 0..ctx-1 of each sequence, the T_b queries being the last
    T_b positions (query i sits at ctx - T_b + i; causal: it sees keys <= its position, bottom-right aligned as in
    flash-attn). Returns [total_q, H_q, d_v] in query's dtype.
    """
    key_cache, block_size = flat_cache(key_cache, block_size, "key_cache")
    value_cache, _ = flat_cache(value_cache, block_size, "value_cache")
    heads_q, d_k = query.shape[1:]
    heads_kv = key_cache.shape[1]
    group = heads_q // heads_kv
    scale = d_k**-0.5 if scale is None else scale
    out = query.new_empty(query.shape[0], heads_q, value_cache.shape[-1])
    for b in range(len(context_lens)):
        lo, hi, ctx = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(context_lens[b])
        if hi == lo:
            continue
        slots = token_slots(block_tables[b : b + 1], block_size, ctx)
        k = key_cache[slots[0]].float().permute(1, 2, 0)  # [H_kv, d_k, L]
        v = value_cache[slots[0]].float().transpose(0, 1)  # [H_kv, L, d_v]
        q = query[lo:hi].float().view(hi - lo, heads_kv, group, d_k).permute(1, 2, 0, 3)  # [H_kv, G, T, d_k]
        scores = (q @ k[:, None]) * scale  # [H_kv, G, T, L]
        query_pos = torch.arange(ctx - (hi - lo), ctx, device=query.device)
        if causal:
            valid = _positions_valid(context_lens[b : b + 1], ctx, None, sliding_window, query_pos[None])[0]
        else:
            valid = torch.ones(hi - lo, ctx, dtype=torch.bool, device=query.device)
        o = _softmax_out(scores, valid, v[:, None], softcap)  # [H_kv, G, T, d_v]
        out[lo:hi] = o.permute(2, 0, 1, 3).reshape(hi - lo, heads_q, -1).to(query.dtype)
    return out


# -- token bitmask -----------------------------------------------------------------------------------------------


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, W] -> bool [B, vocab_size]: bit j of word i (LSB first) allows token 32 * i + j."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask[:, :, None] >> bits) & 1  # arithmetic shift is fine: only bit 0 is kept
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: logits[b, t] = -inf where bit t of row b is 0 (llguidance/xgrammar convention). logits [B, V],
    bitmask int32 [B, >= ceil(V / 32)]. Returns logits."""
    logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))
    return logits
