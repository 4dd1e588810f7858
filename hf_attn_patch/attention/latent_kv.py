"""Latent K/V attention: low-rank keys and values taken before RoPE, keys rebuilt and rotated with exact RoPE.

Notation (per token x_t [D]; H query heads, G key/value heads of d_h dims; ranks r_k, r_v):
    c_k,t = A_k x_t                          [r_k]   k_a_proj, cached
    c_v,t = A_v x_t                          [r_v]   v_a_proj, cached
    k_g,s = RoPE_s(norm(B_k[g] c_k,s + b_k))  [d_h]   k_b_proj, rebuilt for every cached token at attention time
    out_h = sum_s p_h,s c_v,s                [r_v]   attention runs on the latent values directly
    y     = o_proj([out_1 ... out_H])        o_proj holds W_o[h] B_v[g(h)] per head (V's up-projection folded in)
The cache holds r_k + r_v values per token per layer, in the same layout as MLA's (keys = c_k [B, 1, S, r_k],
values = c_v [B, 1, S, r_v]), so every cache that serves MLA serves this module. Unlike MLA's decoupled RoPE key,
no positional signal is dropped: every key dimension is rotated exactly as in the source; only the content is
approximated by the rank. The price: keys cannot be absorbed into the query (RoPE sits between B_k and the score),
so a step rebuilds the keys of its whole context: S * r_k * G * d_h multiply-adds per layer. Decode steps rebuild
them in blocks of KEY_BLOCK tokens with an online softmax, so a step never holds more than a block of keys.

Positions. Keys are rotated by their index in the cache (0..S-1) and queries by theirs (S-T..S-1): RoPE scores
depend only on the distance, which indices give exactly even under left padding (both sides shift alike). A call
with no cached prefix (S == T) uses the model's own position embeddings for both, as the source does (packed
samples with restarting positions stay exact). The RoPE table is the model's frequencies (LatentKVSpec.rope_*).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache.metadata import ForwardContext, get_forward_context
from . import backend
from .base import VariantAttention
from .gqa import GQASpec, RMSNorm, attention_function
from .masks import mask_bias
from .rope import DYNAMIC_ROPE_TYPES, apply_rope, rope_table
from .spec import positive
from ..variants import CacheSpec, Variant, register

KEY_BLOCK = 1024  # cached tokens whose keys a decode step rebuilds at once (memory: KEY_BLOCK * G * d_h per row)
BLOCKWISE_ROWS = 256  # query rows (heads x new tokens) up to which attention runs blockwise with an online softmax


class LatentKVAttention(VariantAttention):
    """Pre-RoPE latent K/V attention (module docstring). Parameter names: q_proj, k_a_proj, k_b_proj, v_a_proj,
    o_proj (+ q_norm, k_norm for models with per-head QK norm)."""

    variant = "latent_kv"

    def __init__(self, config, layer_idx: int, spec: LatentKVSpec):
        super().__init__(config, layer_idx, spec)
        h, g, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
        self.key_rank, self.value_rank = spec.latent_key_rank, spec.latent_value_rank
        # the attention function sees each KV head's group as a batch row: h // g query heads on one key head
        self.num_key_value_groups = h // g
        self.scaling = spec.scaling if spec.scaling is not None else d**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.q_bias)
        self.k_a_proj = nn.Linear(spec.hidden_size, self.key_rank, bias=False)
        self.k_b_proj = nn.Linear(self.key_rank, g * d, bias=spec.k_bias)
        self.v_a_proj = nn.Linear(spec.hidden_size, self.value_rank, bias=False)
        # V's bias folds into o_proj's: sum_s p_s (B_v c_s + b_v) = B_v sum_s p_s c_s + b_v (probabilities sum to 1)
        self.o_proj = nn.Linear(h * self.value_rank, spec.hidden_size, bias=spec.o_bias or spec.v_bias)
        self.q_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None

    # -- pieces ------------------------------------------------------------------------------------------------

    def rope_table(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B or 1, L] (long) -> cos, sin [B or 1, L, d_rot] in the model's cat(freqs, freqs) layout."""
        freqs = torch.tensor(self.spec.rope_frequencies, dtype=torch.float32, device=positions.device)
        angles = positions[..., None].float() * freqs
        angles = torch.cat((angles, angles), -1)
        scale = self.spec.rope_attention_scaling
        return (angles.cos() * scale).to(like.dtype), (angles.sin() * scale).to(like.dtype)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> q [B, H, T, d_h] (normed, before RoPE)."""
        q = self.q_proj(x).view(*x.shape[:2], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return q.transpose(1, 2)

    def keys(self, c_k: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        """c_k [B, 1, S, r_k] -> k [B, G, S, d_h]: rebuilt, normed and rotated (cos, sin [B or 1, S, d_rot])."""
        batch, _, seq, _ = c_k.shape
        k = self.k_b_proj(c_k[:, 0]).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = k.transpose(1, 2)
        return k if cos is None else apply_rope(k, cos, sin)

    # -- forward -----------------------------------------------------------------------------------------------

    def layer_forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
        batch, length, _ = hidden_states.shape
        q = self._queries(hidden_states)
        c_k = self.k_a_proj(hidden_states).unsqueeze(1)
        c_v = self.v_a_proj(hidden_states).unsqueeze(1)
        out = self.engine_forward(q, c_k, c_v)  # an engine step: write, attend over latent pages
        if out is not None:
            return self.o_proj(out.reshape(batch, length, -1)), None
        if cache is not None:
            c_k, c_v = cache.update(c_k, c_v, self.layer_idx)
            context = get_forward_context()
            if backend.reads_pages(context, self.layer_idx, c_k):  # PagedKVCache handed us its pages
                try:
                    c_k, c_v = context.gather(self.layer_idx)
                finally:
                    backend.finish_layer(context, self.layer_idx)
        seq = c_k.shape[2]
        own_positions = None
        if seq == length and position_embeddings is not None:  # no cached prefix: the model's own positions
            rope = position_embeddings
        else:
            own_positions = torch.arange(seq - length, seq, device=q.device)[None]
            rope = None
        out, weights = self.attend(q, c_k, c_v, attention_mask, own_positions, rope, **kwargs)
        return self.o_proj(out.reshape(batch, length, -1)), weights

    def attend(self, q, c_k, c_v, attention_mask, query_positions=None, rope=None, **kwargs):
        """q [B, H, T, d_h] (before RoPE) over the latents c_k [B, 1, S, r_k], c_v [B, 1, S, r_v] -> ([B, T, H, r_v],
        weights or None). RoPE: `rope` = (cos, sin) [B, S, d_rot] for queries and keys alike (S == T), or
        query_positions [B or 1, T] with keys at 0..S-1. attention_mask: as the model built it (4D bool/float, 2D
        padding or None = causal, queries aligned to the last T keys)."""
        if not self.spec.rotary_dim:
            cos_q = sin_q = cos_k = sin_k = None
        elif rope is not None:
            cos_k, sin_k = rope
            cos_q, sin_q = rope
        else:
            seq = c_k.shape[2]
            cos_k, sin_k = self.rope_table(torch.arange(seq, device=q.device)[None], q)
            cos_q, sin_q = self.rope_table(query_positions, q)
        if cos_q is not None:
            q = apply_rope(q, cos_q, sin_q)
        rows = q.shape[1] * q.shape[2]
        dropout = self.spec.dropout if self.training else 0.0
        if rows <= BLOCKWISE_ROWS and not dropout and self.config._attn_implementation != "eager":
            return self._blockwise(q, c_k, c_v, cos_k, sin_k, attention_mask), None
        return self._dense(q, self.keys(c_k, cos_k, sin_k), c_v, attention_mask, dropout, **kwargs)

    def _dense(self, q, k, c_v, attention_mask, dropout, **kwargs):
        """All keys at once through the model's attention function, each KV head's group of queries as one batch
        row: q [B, H, T, d] -> [B*G, H/G, T, d], k [B, G, S, d] -> [B*G, 1, S, d], values c_v for every group."""
        batch, heads, length, d = q.shape
        groups, seq = self.num_kv_heads, k.shape[2]
        qg = q.reshape(batch * groups, heads // groups, length, d)
        kg = k.reshape(batch * groups, 1, seq, d)
        vg = c_v.expand(batch, groups, seq, c_v.shape[-1]).reshape(batch * groups, 1, seq, -1)
        mask = attention_mask
        if mask is not None:
            mask = mask.repeat_interleave(groups, dim=0) if mask.shape[0] == batch and batch > 1 else mask
        out, weights = attention_function(self.config)(
            self,
            qg,
            kg,
            vg,
            mask,
            dropout=dropout,
            scaling=self.scaling,
            sliding_window=self.spec.sliding_window,
            **kwargs,
        )
        out = out.view(batch, groups, length, heads // groups, -1).permute(0, 2, 1, 3, 4)  # [B, T, G, H/G, r_v]
        if weights is not None:
            weights = weights.reshape(batch, heads, length, -1)
        return out.reshape(batch, length, heads, -1), weights

    def _blockwise(self, q, c_k, c_v, cos_k, sin_k, attention_mask):
        """Few query rows (decode, short chunks): keys rebuilt KEY_BLOCK tokens at a time, softmax merged online
        (running max m, sum l): out = sum_s exp(s_s - m) c_v,s / l. q [B, H, T, d] (rotated) -> [B, T, H, r_v]."""
        batch, heads, length, d = q.shape
        groups, seq = self.num_kv_heads, c_k.shape[2]
        rows = heads // groups * length  # query rows per KV head: head h = g * (H/G) + j, row j * T + t
        bias = mask_bias(None, attention_mask, self.spec.sliding_window, (batch, heads, length, seq), q)
        if bias is not None:
            bias = bias.view(batch, groups, rows, seq).float()
        qg = q.reshape(batch, groups, rows, d).float() * self.scaling
        values = c_v.float()
        best = qg.new_full((batch, groups, rows, 1), float("-inf"))
        total = qg.new_zeros((batch, groups, rows, 1))
        acc = qg.new_zeros((batch, groups, rows, values.shape[-1]))
        for start in range(0, seq, KEY_BLOCK):
            stop = min(seq, start + KEY_BLOCK)
            rope = (None, None) if cos_k is None else (cos_k[:, start:stop], sin_k[:, start:stop])
            k = self.keys(c_k[:, :, start:stop], *rope).float()  # [B, G, b, d]
            scores = qg @ k.transpose(-1, -2)  # [B, G, rows, b]
            if bias is not None:
                scores = scores + bias[..., start:stop]
            new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
            p = torch.exp(scores - new_best)
            correction = torch.exp(best - new_best)
            total = total * correction + p.sum(-1, keepdim=True)
            acc = acc * correction + p @ values[:, :, start:stop]
            best = new_best
        out = (acc / total).to(q.dtype).view(batch, groups, heads // groups, length, -1)
        return out.permute(0, 3, 1, 2, 4).reshape(batch, length, heads, -1)


@dataclass(frozen=True, kw_only=True)
class LatentKVSpec(GQASpec):
    """GQA's heads, with keys and values kept as latents c_k [latent_key_rank], c_v [latent_value_rank] taken before
    RoPE; the keys rebuilt from c_k are rotated with the model's RoPE (theta_i per pair, and the rotary embedding's
    cos/sin factor: yarn, longrope; 1 otherwise)."""

    latent_key_rank: int | None
    latent_value_rank: int | None
    rope_frequencies: tuple[float, ...] = ()  # theta_i per RoPE pair (rotary_dim / 2 of them)
    rope_attention_scaling: float = 1.0

    def check(self) -> None:
        """The KV heads (as GQA), the two latent ranks and the model's RoPE frequencies."""
        super().check()
        limit = min(self.hidden_size, self.num_key_value_heads * self.head_dim)
        for name in ("latent_key_rank", "latent_value_rank"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"attention_variant='latent_kv' needs the config field {name}, which is missing")
            positive(name, value)
            if value > limit:
                raise ValueError(
                    f"{name}={value} exceeds the rank of the map it factors "
                    f"(min(hidden_size, num_key_value_heads*head_dim) = {limit})"
                )
        if len(self.rope_frequencies) != self.rotary_dim // 2:
            raise ValueError(
                f"latent_kv needs the model's {self.rotary_dim // 2} RoPE frequencies, got {len(self.rope_frequencies)}"
            )


def spec_fields(config, layer_idx: int, arch, common: dict) -> dict:
    """LatentKVSpec's own fields from a config: KV heads, the two ranks (per layer) and the model's RoPE frequencies,
    which it applies to the keys it rebuilds (so only static RoPE types)."""
    frequencies, attention_scaling = (), 1.0
    if arch.rotary:
        rope_type = (config.rope_parameters or {}).get("rope_type", "default")
        if rope_type in DYNAMIC_ROPE_TYPES:
            raise ValueError(
                f"rope_type={rope_type!r} changes its frequencies with the length: attention_variant='latent_kv' "
                "rotates cached keys itself and supports static RoPE types only"
            )
        frequencies, attention_scaling = rope_table(config)
    return dict(
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or common["num_attention_heads"],
        scaling=arch.scaling(config, layer_idx, common["head_dim"]),
        latent_key_rank=layer_latent_rank(config, layer_idx, "latent_key_rank"),
        latent_value_rank=layer_latent_rank(config, layer_idx, "latent_value_rank"),
        rope_frequencies=frequencies,
        rope_attention_scaling=attention_scaling,
    )


def cache_spec(config, layer_idx: int) -> CacheSpec:
    """The key latent and the value latent (before RoPE), one row [c_k | c_v] per token."""
    key_rank = layer_latent_rank(config, layer_idx, "latent_key_rank")
    return CacheSpec("latent_kv", 1, key_rank, layer_latent_rank(config, layer_idx, "latent_value_rank"), fused=True)


def latent_factors(attn: LatentKVAttention) -> list:
    """c_k = k_a_proj x read by k_b_proj; c_v = v_a_proj x read by each query head's block of o_proj's input."""
    return [
        (attn.k_a_proj, slice(0, attn.key_rank), attn.k_b_proj, 1),
        (attn.v_a_proj, slice(0, attn.value_rank), attn.o_proj, attn.num_heads),
    ]


def layer_latent_rank(config, layer_idx: int, field: str) -> int | None:
    """A latent_kv rank of one layer: config.<field> is one int for every layer or a list with one per layer."""
    value = getattr(config, field, None)
    if isinstance(value, (list, tuple)):
        if len(value) != config.num_hidden_layers:
            raise ValueError(f"{field} has {len(value)} entries, num_hidden_layers={config.num_hidden_layers}")
        return value[layer_idx]
    return value


def paged_forward(module, q, c_k, c_v, context: ForwardContext) -> torch.Tensor:
    """Latent K/V attention (attention/latent_kv.py) over latent pages: q [1, H, T, d_h] (before RoPE), the new
    c_k [1, 1, T, r_k], c_v [1, 1, T, r_v] -> [1, T, H, r_v]. The storage holds [c_k | c_v] per token (H = 1).
    Keys are rotated at their positions 0..L-1; a chunk's n queries sit at L-n..L-1 and a decode at its last
    visible position (decodes of a group are padded to the longest)."""
    meta, layer = context.metadata, module.layer_idx
    storage = backend.write_new(context, layer, c_k, c_v)
    group, window = meta.layer_groups[layer], module.spec.sliding_window
    out = q.new_empty((q.shape[2], q.shape[1], module.value_rank))
    for i, (selector, blocks, visible) in enumerate(backend.segments(meta, group, window)):
        length = visible.shape[-1]
        latent_k, latent_v = backend.read_segment(storage, meta, (group, window, i), blocks, length)  # [b, 1, L, r]
        if isinstance(selector, slice):
            queries = q[:, :, selector]  # [1, H, n, d_h]
            positions = torch.arange(length - queries.shape[2], length, device=q.device)[None]
        else:
            queries = q[0][:, selector].transpose(0, 1)[:, :, None]  # [g, H, 1, d_h]
            positions = (length - 1 - visible[:, 0, 0].flip(-1).int().argmax(-1))[:, None]
        o, _ = module.attend(queries, latent_k.to(q.dtype), latent_v.to(q.dtype), visible, positions)
        out[selector] = o[0] if isinstance(selector, slice) else o[:, 0]
    return out[None]


VARIANT = register(
    Variant(
        "latent_kv",
        LatentKVAttention,
        LatentKVSpec,
        spec_fields,
        cache_spec,
        paged_forward=paged_forward,
        latent_factors=latent_factors,
    )
)
