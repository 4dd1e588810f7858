"""The shape of one attention layer, independent of the architecture it came from.

Field names follow the config fields they are read from (DeepSeek names for MLA), so a validation error names the
field a user has to fix in config.json.
"""

from __future__ import annotations

from dataclasses import dataclass

VARIANTS = ("gqa", "mla", "latent_kv")


@dataclass(frozen=True)
class AttentionSpec:
    """Everything GroupedQueryAttention / MultiHeadLatentAttention need to build themselves.

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
        if self.variant not in VARIANTS:
            raise ValueError(f"attention_variant={self.variant!r} is not one of {VARIANTS}")
        _positive("num_attention_heads", self.num_attention_heads)
        _positive("hidden_size", self.hidden_size)
        if self.variant == "gqa":
            self._validate_gqa()
        elif self.variant == "mla":
            self._validate_mla()
        else:
            self._validate_latent_kv()

    def _validate_gqa(self) -> None:
        h, h_kv = self.num_attention_heads, self.num_key_value_heads
        _positive("num_key_value_heads", h_kv)
        if h % h_kv:
            raise ValueError(
                f"num_key_value_heads={h_kv} must divide num_attention_heads={h} (GQA groups need equal size)"
            )

    def _validate_latent_kv(self) -> None:
        self._validate_gqa()
        kv_width = self.num_key_value_heads * self.head_dim
        for name in ("latent_key_rank", "latent_value_rank"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"attention_variant='latent_kv' needs the config field {name}, which is missing")
            _positive(name, value)
            limit = min(self.hidden_size, kv_width)
            if value > limit:
                raise ValueError(f"{name}={value} exceeds the rank of the map it factors (min(hidden_size, "
                                 f"num_key_value_heads*head_dim) = {limit})")  # fmt: skip
        if len(self.rope_frequencies) != self.rotary_dim // 2:
            raise ValueError(f"latent_kv needs the model's {self.rotary_dim // 2} RoPE frequencies, got "
                             f"{len(self.rope_frequencies)}")  # fmt: skip

    def _validate_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) is None:
                raise ValueError(f"attention_variant='mla' needs the config field {name}, which is missing")
        _positive("kv_lora_rank", self.kv_lora_rank)
        _positive("v_head_dim", self.v_head_dim)
        _non_negative("qk_nope_head_dim", self.qk_nope_head_dim)
        _non_negative("qk_rope_head_dim", self.qk_rope_head_dim)
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
            _positive("q_lora_rank", self.q_lora_rank)
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


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _non_negative(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")
