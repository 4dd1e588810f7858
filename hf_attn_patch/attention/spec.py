"""The shape of one attention layer, independent of the architecture it came from.

Field names follow the config fields they are read from (DeepSeek names for MLA), so a validation error names the
field a user has to fix in config.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..variants import variant_of


@dataclass(frozen=True)
class AttentionSpec:
    """What every attention variant's module reads of a layer; each variant subclasses it with its own fields
    (GQASpec in gqa.py, MLASpec in mla.py, LatentKVSpec in latent_kv.py) and checks them in `check()`.

    The registry (variants.py) names each variant's spec class; models/architectures.py fills these common fields
    from the architecture and the variant's own through its `spec_fields(config, layer_idx, arch, common)`.
    """

    variant: str
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    rotary_dim: int  # RoPE dims per head the model's rotary embedding produces; 0 for learned positions (gpt2, opt)
    q_bias: bool = False  # bias of the first query projection (q_proj, or q_a_proj under q_lora_rank)
    k_bias: bool = False
    v_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3)
    norm_eps: float = 1e-6
    scaling: float | None = None  # None: 1/sqrt(d_qk), d_qk the variant's query-key dims
    sliding_window: int | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        variant = variant_of(self.variant)  # raises naming an unknown variant
        if not isinstance(self, variant.spec):
            raise ValueError(
                f"attention_variant={self.variant!r} takes a {variant.spec.__name__}, not a {type(self).__name__}"
            )
        positive("num_attention_heads", self.num_attention_heads)
        positive("hidden_size", self.hidden_size)
        self.check()

    def check(self) -> None:
        """The variant's own fields; a ValueError names the config field to fix."""


def positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def non_negative(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")
