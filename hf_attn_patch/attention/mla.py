"""Multi-head latent attention (DeepSeek-V2/V3), with a naive and an absorbed compute path.

Notation (per token, H heads): d_c = kv_lora_rank, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim, d_v = v_head_dim.
    c_t      = norm(W_DKV x_t)                      [d_c]      the latent, cached
    k_rope_t = RoPE(W_KR x_t)                       [d_r]      one RoPE key shared by all heads, cached
    k_h,t    = [W_UK[h] c_t ; k_rope_t]             [d_n+d_r]  v_h,t = W_UV[h] c_t  [d_v]
    q_h,t    = [q_nope ; RoPE(q_rope)]              [d_n+d_r]  from W_Q x (or W_UQ norm(W_DQ x) with q_lora_rank)
    score    = q_h . k_h * 1/sqrt(d_n + d_r)
The cache holds only (c_t, k_rope_t): d_c + d_r values per token per layer, in transformers' DeepSeek-V3 layout
(keys = c [B, 1, S, d_c], values = k_rope [B, 1, S, d_r]), so any cache that serves DeepSeek serves this module.

Naive path: expand K, V for all H heads from the cache, run ordinary attention (best for long prefills).
Absorbed path: q_nope . (W_UK c) = (W_UK^T q_nope) . c, and sum_s p_s W_UV c_s = W_UV (sum_s p_s c_s), so
    score = (W_UK[h]^T q_nope) . c_s + q_rope . k_rope_s,   out_h = W_UV[h] (sum_s p_s c_s)
attention runs over the latent, like MQA with one d_c + d_r key head: no per-token expansion (best for decode).
Parameter names are DeepSeek-V3's, so its checkpoints load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache import metadata
from ..cache.metadata import AttentionMetadata, ForwardContext, get_forward_context
from ..kv_memory import head_dim
from . import backend
from .base import VariantAttention
from .gqa import RMSNorm, attention_function
from .masks import mask_bias
from .rope import apply_rope, deinterleave, select_rope_pairs
from .spec import AttentionSpec, non_negative, positive
from ..variants import CacheSpec, Variant, register

ABSORB_MODES = ("auto", "always", "never")


class MultiHeadLatentAttention(VariantAttention):
    """DeepSeek MLA. `absorb` picks the compute path: "auto" (by FLOP count), "always" or "never"."""

    variant = "mla"

    def __init__(self, config, layer_idx: int, spec: MLASpec):
        super().__init__(config, layer_idx, spec)
        h, d_c = spec.num_attention_heads, spec.kv_lora_rank
        self.num_heads, self.kv_lora_rank = h, d_c
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = (
            spec.qk_nope_head_dim,
            spec.qk_rope_head_dim,
            spec.v_head_dim,
        )
        self.qk_head_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        self.num_key_value_groups = 1  # the naive path hands the attention function H expanded K/V heads
        self.scaling = spec.scaling if spec.scaling is not None else self.qk_head_dim**-0.5
        self.is_causal = True
        self.absorb = "auto"

        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(spec.hidden_size, h * self.qk_head_dim, bias=spec.q_bias)
        else:
            self.q_a_proj = nn.Linear(spec.hidden_size, spec.q_lora_rank, bias=spec.q_bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.norm_eps)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, h * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            spec.hidden_size, d_c + self.qk_rope_head_dim, bias=spec.k_bias or spec.v_bias
        )
        self.kv_a_layernorm = RMSNorm(d_c, spec.norm_eps) if spec.mla_latent_norm else None
        self.kv_b_proj = nn.Linear(d_c, h * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_head_dim, spec.hidden_size, bias=spec.o_bias)
        # A plain tuple, not a buffer: from_pretrained builds modules on the meta device and would leave a
        # non-persistent buffer uninitialized.
        self.rope_pairs = spec.rope_pair_index()

    # -- pieces shared by both paths ---------------------------------------------------------------------------

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q_nope [B, H, T, d_n], q_rope [B, H, T, d_r] (before RoPE)."""
        if self.spec.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*x.shape[:2], self.num_heads, self.qk_head_dim).transpose(1, 2)
        return q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> c [B, 1, T, d_c] (normed), k_rope [B, 1, T, d_r] (before RoPE)."""
        c, k_rope = self.kv_a_proj_with_mqa(x).unsqueeze(1).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        if self.kv_a_layernorm is not None:
            c = self.kv_a_layernorm(c)
        return c, k_rope

    def _rope(self, q_rope, k_rope, position_embeddings):
        """q_rope [B, H, T, d_r], k_rope [B, 1, T, d_r] -> both rotated, in one pass over the H + 1 heads."""
        if not self.qk_rope_head_dim:
            return q_rope, k_rope
        if torch.is_tensor(position_embeddings) and position_embeddings.is_complex():  # DeepSeek-V2's freqs_cis
            half_cos, half_sin = position_embeddings.real, position_embeddings.imag  # [B, T, d_r / 2]
            position_embeddings = (torch.cat((half_cos, half_cos), -1), torch.cat((half_sin, half_sin), -1))
        cos, sin = position_embeddings
        if self.rope_pairs is not None:
            cos, sin = select_rope_pairs(cos, sin, torch.tensor(self.rope_pairs, device=cos.device))
        both = torch.cat((q_rope, k_rope), 1)
        if self.spec.rope_interleave:
            both = deinterleave(both)
        return apply_rope(both, cos, sin).split((self.num_heads, 1), 1)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, d_n, d_c], W_UV [H, d_v, d_c]: views of kv_b_proj.weight (rows: per head k_nope then v)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def use_absorbed(self, num_queries: int) -> bool:
        """FLOPs per head for S cached tokens, T queries:
        naive    S*d_c*(d_n+d_v) [expand]  + T*S*(d_n+d_r+d_v) [attend]
        absorbed T*S*(2*d_c+d_r) [attend over the latent] (+ S-independent absorption terms)
        absorbed wins iff T*(2*d_c + d_r - d_n - d_r - d_v) < d_c*(d_n + d_v).
        """
        if self.absorb != "auto":
            return self.absorb == "always"
        proj = self.kv_b_proj
        plain = type(proj) is nn.Linear or type(proj).__dict__.get("plain_weight", False)  # models/fast_linear.py
        if not proj.weight.is_floating_point() or not plain:
            return False  # quantized / wrapped up-projection: its weight cannot be folded as a plain matrix
        d_c, d_n, d_v = self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim
        return num_queries * (2 * d_c - d_n - d_v) < d_c * (d_n + d_v)

    # -- forward -----------------------------------------------------------------------------------------------

    def layer_forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
        if self.absorb not in ABSORB_MODES:
            raise ValueError(f"absorb={self.absorb!r} is not one of {ABSORB_MODES}")
        batch, length, _ = hidden_states.shape
        q_nope, q_rope = self._queries(hidden_states)
        c, k_rope = self._latent(hidden_states)
        q_rope, k_rope = self._rope(q_rope, k_rope, position_embeddings)
        out = self.engine_forward(q_nope, q_rope, c, k_rope)  # an engine step: write, attend over latent pages
        if out is not None:
            return self.o_proj(out.reshape(batch, length, -1)), None
        if cache is not None:
            c, k_rope = cache.update(c, k_rope, self.layer_idx)
            context = get_forward_context()
            if backend.reads_pages(context, self.layer_idx, c):  # PagedKVCache's decode step handed us its pages
                out = cache_decode(self, q_nope, q_rope, c, context) if length == 1 else None
                if out is not None:
                    return self.o_proj(out.reshape(batch, length, -1)), None
                c, k_rope = context.gather(self.layer_idx)
        if self.use_absorbed(length):
            out, weights = self._absorbed(q_nope, q_rope, c, k_rope, attention_mask)
        else:
            out, weights = self._naive(q_nope, q_rope, c, k_rope, attention_mask, **kwargs)
        return self.o_proj(out.reshape(batch, length, -1)), weights

    def _naive(self, q_nope, q_rope, c, k_rope, attention_mask, **kwargs):
        """Expand k_nope, v [B, H, S, d] from the latent and call the model's attention function."""
        batch, _, seq, _ = c.shape
        kv = self.kv_b_proj(c.squeeze(1)).view(batch, seq, self.num_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return attention_function(self.config)(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.spec.dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.spec.sliding_window,
            **kwargs,
        )

    def _absorbed(self, q_nope, q_rope, c, k_rope, attention_mask):
        """Attention over the latent: all H*T query rows share one latent key/value "head" (MQA-like).

        q_nope [B, H, T, d_n], q_rope [B, H, T, d_r], c [B, 1, S, d_c], k_rope [B, 1, S, d_r] -> ([B, T, H, d_v], None)
            q_latent = q_nope W_UK[h]                                            [B, H*T, d_c]
            scores   = scaling * (q_latent . c + q_rope . k_rope), plus 0 / finfo.min for the mask   [B, H*T, S]
            out_h    = W_UV[h] (softmax(scores) c)
        On CPU (fp32/fp64, no dropout, few query rows: decode; `_gemm_attention`) the middle line is two GEMMs and
        a softmax, which use every thread; one GEMM over [c | k_rope] when the cache stores them side by side
        (PagedKVCache). Else one SDPA call with the RoPE scores and mask as its additive bias (no [H*T, S]
        probabilities): on CPU it runs a decode's few query rows as one block on one thread.
        """
        w_uk, w_uv = self._up_weights()
        batch, heads, length, _ = q_nope.shape
        seq, rows = c.shape[2], heads * length
        shape = (batch, heads, length, seq)
        # W_UK^T folded into the query: per head [B*T, d_n] @ [d_n, d_c] (views for one row)
        q_latent = torch.bmm(q_nope.transpose(0, 1).reshape(heads, batch * length, -1), w_uk)
        q_latent = q_latent.view(heads, batch, length, -1).transpose(0, 1).reshape(batch, rows, -1)
        if _gemm_attention(c, rows, self.training and self.spec.dropout):
            joint = _joint_rows(c, k_rope) if self.qk_rope_head_dim else c
            if joint is not None:  # one GEMM over [c | k_rope]
                query = q_latent if joint is c else torch.cat((q_latent, q_rope.reshape(batch, rows, -1)), -1)
                scores = torch.bmm(query * self.scaling, joint.squeeze(1).transpose(1, 2))
            else:
                scores = torch.bmm(q_rope.reshape(batch, rows, -1) * self.scaling, k_rope.squeeze(1).transpose(1, 2))
                scores = scores.baddbmm_(q_latent, c.squeeze(1).transpose(1, 2), alpha=self.scaling)
            scores = mask_bias(scores, attention_mask, self.spec.sliding_window, shape, q_latent)
            out_latent = torch.bmm(torch.softmax(scores, -1), c.squeeze(1))  # sum_s p_s c_s  [B, H*T, d_c]
        else:
            bias = None
            if self.qk_rope_head_dim:
                bias = torch.bmm(q_rope.reshape(batch, rows, -1) * self.scaling, k_rope.squeeze(1).transpose(1, 2))
            bias = mask_bias(bias, attention_mask, self.spec.sliding_window, shape, q_latent)
            out_latent = nn.functional.scaled_dot_product_attention(
                q_latent[:, None],
                c,
                c,
                attn_mask=None if bias is None else bias[:, None],
                scale=self.scaling,
                dropout_p=self.spec.dropout if self.training else 0.0,
            )[:, 0]
        # W_UV folded out: per head [B*T, d_c] @ [d_c, d_v] -> [B, T, H, d_v]
        out_latent = out_latent.view(batch, heads, length, -1).transpose(0, 1).reshape(heads, batch * length, -1)
        out = torch.bmm(out_latent, w_uv.transpose(1, 2)).view(heads, batch, length, -1).permute(1, 2, 0, 3)
        return out, None


GEMM_ATTENTION_ROWS = 256  # query rows (heads x new tokens) up to which CPU attention over the latent uses GEMMs


def _gemm_attention(c: torch.Tensor, rows: int, dropout) -> bool:
    """Whether attention over the latent runs as GEMMs + softmax: on CPU in fp32/fp64 without dropout, with more
    than one thread, for at most GEMM_ATTENTION_ROWS query rows. CPU SDPA splits its work by query block, so a
    decode's few rows run on one thread, while the GEMMs split the cached tokens across threads. With one thread
    SDPA's single pass over the cache wins (the GEMMs read it twice: 8% slower at 4K tokens, 10% at 16K, in
    scripts/bench_kernels.py mla-decode). Long absorbed prefills keep SDPA's blockwise softmax."""
    return (
        c.is_cpu
        and c.dtype in (torch.float32, torch.float64)
        and not dropout
        and rows <= GEMM_ATTENTION_ROWS
        and torch.get_num_threads() > 1
    )


def _joint_rows(c: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor | None:
    """[B, 1, S, d_c + d_r]: a view of c and k_rope together when each token's k_rope directly follows its c in
    memory (a cache that stores [c | k_rope] rows, as PagedKVCache does); else None."""
    d_c, d_r = c.shape[-1], k_rope.shape[-1]
    if (
        c.stride() != k_rope.stride()
        or c.shape[:-1] != k_rope.shape[:-1]
        or c.stride(-1) != 1
        or c.stride(-2) != d_c + d_r
        or c.dtype != k_rope.dtype
        or k_rope.data_ptr() != c.data_ptr() + d_c * c.element_size()
    ):
        return None
    return c.as_strided((*c.shape[:-1], d_c + d_r), c.stride())


@dataclass(frozen=True, kw_only=True)
class MLASpec(AttentionSpec):
    """The latent c_t of kv_lora_rank dims; per head k_nope [qk_nope_head_dim] and v [v_head_dim] up-projected from
    it; one RoPE key of qk_rope_head_dim dims shared by all heads; queries [qk_nope_head_dim + qk_rope_head_dim],
    through a q_lora_rank latent when set. DeepSeek's config names."""

    kv_lora_rank: int | None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None
    qk_rope_head_dim: int | None
    v_head_dim: int | None
    mla_latent_norm: bool = True  # RMSNorm on c_t (DeepSeek's kv_a_layernorm)
    mla_rope_pairs: tuple[int, ...] | None = None  # which source frequency pairs the decoupled RoPE key carries
    rope_interleave: bool = False  # DeepSeek checkpoints store rotary dims as interleaved pairs

    def check(self) -> None:
        """MLA's fields: the latent, RoPE and head dims, within the ranks of the maps they factor."""
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) is None:
                raise ValueError(f"attention_variant='mla' needs the config field {name}, which is missing")
        positive("kv_lora_rank", self.kv_lora_rank)
        positive("v_head_dim", self.v_head_dim)
        non_negative("qk_nope_head_dim", self.qk_nope_head_dim)
        non_negative("qk_rope_head_dim", self.qk_rope_head_dim)
        if self.qk_nope_head_dim + self.qk_rope_head_dim == 0:
            raise ValueError("qk_nope_head_dim=0 and qk_rope_head_dim=0: queries and keys would have no dims")
        # c_t = W_DKV x factors [W_K_nope; W_V] (hidden -> H*(d_nope+d_v)): its rank is at most the smaller side.
        kv_limit = min(self.hidden_size, self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim))
        if self.kv_lora_rank > kv_limit:
            raise ValueError(
                f"kv_lora_rank={self.kv_lora_rank} exceeds the rank of the K/V map it factors "
                f"(min(hidden_size, num_attention_heads*(qk_nope_head_dim+v_head_dim)) = {kv_limit})"
            )
        if self.q_lora_rank is not None:
            positive("q_lora_rank", self.q_lora_rank)
            q_limit = min(self.hidden_size, self.num_attention_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim))
            if self.q_lora_rank > q_limit:
                raise ValueError(f"q_lora_rank={self.q_lora_rank} exceeds the rank of the query map ({q_limit})")
        d_r = self.qk_rope_head_dim
        if d_r % 2:
            raise ValueError(f"qk_rope_head_dim={d_r} must be even (RoPE rotates pairs of dims)")
        if d_r and not self.rotary_dim:
            raise ValueError(
                f"qk_rope_head_dim={d_r} but this architecture has no rotary embedding (learned positions): use 0"
            )
        if self.mla_rope_pairs is not None:
            if len(self.mla_rope_pairs) != d_r // 2:
                raise ValueError(
                    f"mla_rope_pairs has {len(self.mla_rope_pairs)} entries, qk_rope_head_dim={d_r} needs {d_r // 2}"
                )
            bad = [i for i in self.mla_rope_pairs if not 0 <= i < self.rotary_dim // 2]
            if bad:
                raise ValueError(
                    f"mla_rope_pairs={bad} out of range: the rotary embedding has {self.rotary_dim // 2} pairs"
                )
        elif d_r > self.rotary_dim:
            raise ValueError(
                f"qk_rope_head_dim={d_r} exceeds the {self.rotary_dim} rotary dims of the model; "
                "set mla_rope_pairs to repeat frequencies"
            )

    def rope_pair_index(self) -> tuple[int, ...] | None:
        """Source frequency pairs of MLA's RoPE key; None when it uses the model's rotary dims as they are.

        Without `mla_rope_pairs`, d_r/2 pairs evenly spaced over the model's d_rot/2: for DeepSeek-style
        frequencies theta^(-2i/d_r) this picks exactly them when d_rot is a multiple of d_r.
        """
        d_r, d_rot = self.qk_rope_head_dim, self.rotary_dim
        if self.mla_rope_pairs is not None:
            return tuple(self.mla_rope_pairs)
        if d_r == d_rot or d_r == 0:
            return None
        return tuple((i * (d_rot // 2)) // (d_r // 2) for i in range(d_r // 2))


def spec_fields(config, layer_idx: int, arch, common: dict) -> dict:
    """MLASpec's own fields from a config, per layer where a conversion chose per-layer sizes."""
    fields = {
        name: getattr(config, name, None)
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    }
    if fields["qk_nope_head_dim"] is None or fields["qk_rope_head_dim"] is None:
        return fields  # validate() names the missing field
    fields["kv_lora_rank"] = layer_kv_lora_rank(config, layer_idx)
    fields["qk_rope_head_dim"] = layer_qk_rope_head_dim(config, layer_idx)
    pairs = getattr(config, "mla_rope_pairs", None)
    if pairs and isinstance(pairs[0], (list, tuple)):  # one list per layer (converted models choose per layer)
        if len(pairs) != config.num_hidden_layers:
            raise ValueError(
                f"mla_rope_pairs has {len(pairs)} per-layer lists, num_hidden_layers={config.num_hidden_layers}"
            )
        pairs = pairs[layer_idx]
    return dict(
        **fields,
        scaling=arch.mla_scaling(config, layer_idx, fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]),
        mla_latent_norm=bool(getattr(config, "mla_latent_norm", True)),
        mla_rope_pairs=None if pairs is None else tuple(pairs),
        rope_interleave=arch.rope_interleave
        if arch.rope_interleave is not None
        else bool(getattr(config, "rope_interleave", False)),
    )


def cache_spec(config, layer_idx: int) -> CacheSpec:
    """The latent and the shared RoPE key, one row [c | k_rope] per token (the latent decode kernel reads it)."""
    return CacheSpec(
        "mla", 1, layer_kv_lora_rank(config, layer_idx), layer_qk_rope_head_dim(config, layer_idx), fused=True
    )


def mha_values(config) -> int:
    """Values per token as MHA: a converted model's source heads (2 * H * d_h); DeepSeek's own q/k and v head sizes
    for a native one (H * (d_nope + d_rope + d_v))."""
    heads = config.num_attention_heads
    if getattr(config, "attention_variant", None) is None:
        return heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return 2 * heads * head_dim(config)


def latent_factors(attn: MultiHeadLatentAttention) -> list:
    """The KV latent: kv_a_proj_with_mqa's first kv_lora_rank rows, read by kv_b_proj, where no RMSNorm sits between
    them (the query latent always has one: q_a_layernorm's scale-invariance admits no basis change)."""
    if attn.kv_a_layernorm is not None:
        return []
    return [(attn.kv_a_proj_with_mqa, slice(0, attn.kv_lora_rank), attn.kv_b_proj, 1)]


# -- config readers ------------------------------------------------------------------------------------------


def layer_kv_lora_rank(config, layer_idx: int) -> int | None:
    """MLA latent size of one layer: `mla_kv_lora_ranks[layer_idx]` when a conversion chose ranks per layer, else the
    config's `kv_lora_rank` (then the largest rank: what DeepSeek-style code sizes by)."""
    return _per_layer(config, layer_idx, "mla_kv_lora_ranks", "kv_lora_rank")


def layer_qk_rope_head_dim(config, layer_idx: int) -> int | None:
    """MLA shared RoPE key size of one layer: `mla_qk_rope_head_dims[layer_idx]` when a conversion chose it per layer
    (converters/methods/budgets.py), else the config's `qk_rope_head_dim`."""
    return _per_layer(config, layer_idx, "mla_qk_rope_head_dims", "qk_rope_head_dim")


def _per_layer(config, layer_idx: int, per_layer_field: str, field: str) -> int | None:
    """config.<per_layer_field>[layer_idx] when the config has that list (one entry per layer), else config.<field>."""
    values = getattr(config, per_layer_field, None)
    if values is None:
        return getattr(config, field, None)
    if len(values) != config.num_hidden_layers:
        raise ValueError(f"{per_layer_field} has {len(values)} entries, num_hidden_layers={config.num_hidden_layers}")
    return values[layer_idx]


# -- the paged forward (the engine) and the paged cache decode ---------------------------------------------


def paged_forward(module, q_nope, q_rope, latent, k_rope, context: ForwardContext) -> torch.Tensor:
    """MLA over latent pages: q [1, H, T, *], new latent [1, 1, T, d_c], k_rope [1, 1, T, d_r] -> [1, T, H, d_v].

    The storage holds [c | k_rope] per token (H = 1). CUDA decode: kernels.mla_decode with block tables; otherwise
    the module's absorbed attention per segment (torch)."""
    meta, layer = context.metadata, module.layer_idx
    storage = backend.write_new(context, layer, latent, k_rope)
    group = meta.layer_groups[layer]
    window = module.spec.sliding_window
    if metadata.use_kernels(q_nope) and meta.is_decode and window is None and module.qk_rope_head_dim:
        return kernel_decode(module, q_nope[0].transpose(0, 1), q_rope[0].transpose(0, 1), storage.rows, meta)[None]
    out = q_nope.new_empty((q_nope.shape[2], q_nope.shape[1], module.v_head_dim))
    for i, (selector, blocks, visible) in enumerate(backend.segments(meta, group, window)):  # the torch reference
        c, rope = backend.read_segment(
            storage, meta, (group, window, i), blocks, visible.shape[-1]
        )  # [b, 1, L, d_c / d_r]
        if isinstance(selector, slice):
            qn, qr = q_nope[:, :, selector], q_rope[:, :, selector]
        else:
            qn, qr = (x[0][:, selector].transpose(0, 1)[:, :, None] for x in (q_nope, q_rope))
        o, _ = module._absorbed(qn, qr, c.to(q_nope.dtype), rope.to(q_nope.dtype), visible)
        out[selector] = o[0] if isinstance(selector, slice) else o[:, 0]
    return out[None]


def kernel_decode(module, q_nope, q_rope, flat, meta: AttentionMetadata) -> torch.Tensor:
    """kernels.mla_decode by block table: q_nope [B, H, d_n], q_rope [B, H, d_r] (one token per sequence), flat
    latent pages [slots, 1, d_c + d_r] -> [B, H, d_v] (W_UK folded into the query, W_UV applied to the output)."""
    from hf_attn_patch.kernels.ops import mla_decode

    w_uk, w_uv = module._up_weights()
    q_latent = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    group = meta.layer_groups[module.layer_idx]
    out_latent = mla_decode(
        q_latent,
        q_rope,
        flat,
        meta.block_tables[group],
        meta.seq_lens,
        block_size=meta.block_size,
        scale=module.scaling,
        validate=False,
    )
    return torch.einsum("bhc,hvc->bhv", out_latent.to(q_nope.dtype), w_uv)


def cache_decode(module, q_nope, q_rope, latent, context: ForwardContext):
    """MLA decode over PagedKVCache's pages (CUDA, no window): q [B, H, 1, *] -> [B, 1, H, d_v], or None when the
    module must run its own path on gathered tensors (`context.gather`)."""
    layer = module.layer_idx
    try:
        storage = context.storage[layer]
        if module.spec.sliding_window is not None or not module.qk_rope_head_dim or latent.dtype != q_nope.dtype:
            return None
        return kernel_decode(module, q_nope[:, :, 0], q_rope[:, :, 0], storage.rows, context.metadata)[:, None]
    finally:
        backend.finish_layer(context, layer)


VARIANT = register(
    Variant(
        "mla",
        MultiHeadLatentAttention,
        MLASpec,
        spec_fields,
        cache_spec,
        paged_forward=paged_forward,
        latent_factors=latent_factors,
        native_model_types=("deepseek_v2", "deepseek_v3"),
        mha_values=mha_values,
    )
)
