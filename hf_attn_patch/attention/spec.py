"""The shape of one attention layer, independent of the architecture it came from.

Field names follow the config fields they are read from (DeepSeek names for MLA), so a validation error names the
field a user has to fix in config.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..variants import variant_of


@dataclass(frozen=True)
class AttentionSpec:
    """Everything an attention variant's module needs to build itself (each variant validates its own fields).

    GQA: q [H, d_h], k/v [H_kv, d_h]; MHA is H_kv = H, MQA is H_kv = 1.
    MLA: latent c_t of kv_lora_rank dims, per-head k_nope [qk_nope_head_dim] and v [v_head_dim] up-projected from
    it, one RoPE key of qk_rope_head_dim dims shared by all heads; queries [qk_nope_head_dim + qk_rope_head_dim].
    latent_kv: latents c_k [latent_key_rank], c_v [latent_value_rank] taken before RoPE; keys of the
    num_key_value_heads heads rebuilt from c_k and rotated with the model's RoPE (rope_frequencies).
    """

    variant: str
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    rotary_dim: int  # RoPE dims per head the model's rotary embedding produces; 0 for learned positions (gpt2, opt)
    num_key_value_heads: int | None = None  # gqa
    q_bias: bool = False  # bias of the first query projection (q_proj, or q_a_proj under q_lora_rank)
    k_bias: bool = False
    v_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3)
    norm_eps: float = 1e-6
    scaling: float | None = None  # None: 1/sqrt(d_qk), d_qk = head_dim (gqa) or nope + rope dims (mla)
    sliding_window: int | None = None
    dropout: float = 0.0
    # mla
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    mla_latent_norm: bool = True  # RMSNorm on c_t (DeepSeek's kv_a_layernorm)
    mla_rope_pairs: tuple[int, ...] | None = None  # which source frequency pairs the decoupled RoPE key carries
    rope_interleave: bool = False  # DeepSeek checkpoints store rotary dims as interleaved pairs
    # latent_kv
    latent_key_rank: int | None = None
    latent_value_rank: int | None = None
    rope_frequencies: tuple[float, ...] = ()  # theta_i per RoPE pair (rotary_dim / 2 of them)
    rope_attention_scaling: float = 1.0  # the rotary embedding's cos/sin factor (yarn, longrope; 1 otherwise)

    def __post_init__(self) -> None:
        variant = variant_of(self.variant)  # raises naming an unknown variant
        positive("num_attention_heads", self.num_attention_heads)
        positive("hidden_size", self.hidden_size)
        variant.validate(self)  # the variant's own fields (variants.py)

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


def positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def non_negative(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")
