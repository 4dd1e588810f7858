"""The deepseek_v3 export (deepseek_export.py says what it does and why) as per-layer pieces, so a whole model
(deepseek_export.to_deepseek_v3) and the layer-streamed conversion (stages/export.py) build the same tensors:

    export_shape(native_config, ...)   the stock config and the row maps (q [H(d_h + d_out)], kv_a [d_c + d_out])
    LatentStats                        per layer, from the latent c = kv_a_proj(x)[:, :d_c] of every calibration
                                       token: max ms(c) ("linear") or E[c c^T / r], E[c c^T / r^2] ("fit")
    export_layer(state, i, ...)        layer i's tensors: rows permuted and scaled, the latent norm, the query LoRA
    export_resident(state, shape)      embeddings times the residual scale k, an LM head of its own
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...models.architectures import head_dim
from .constants import EXPORT_EPS, LATENT_RMS, LINEAR_MARGIN, Q_SCALE
from .stock_rope import stock_rope_theta


@dataclass
class ExportShape:
    """d_r, d_c, d_h: the native conversion's RoPE dims, latent rank, head dim; d_out: the export's RoPE dims;
    q_index / kv_index: rows of the export's q / kv_a projections in the native ones (-1: a zero row);
    q_rescale: sqrt((d_h + d_out) / (d_h + d_r)); k: the residual scale sqrt(EXPORT_EPS / eps); q_in, q_gain: the
    query LoRA's input scale and norm gain; q_lora: llama.cpp's query LoRA of rank hidden_size."""

    d_r: int
    d_c: int
    d_h: int
    d_out: int
    hidden: int
    q_index: list[int]
    kv_index: list[int]
    q_rescale: float
    k: float
    q_in: float
    q_gain: float
    q_lora: bool
    latent_norm: str


def export_shape(src, engine: str, rope_dim: int | None, latent_norm: str) -> ExportShape:
    """The row maps and scales from the native MLA config `src` (every layer d_r RoPE dims, d_c latent dims)."""
    d_r, d_c, d_h = src.qk_rope_head_dim, src.kv_lora_rank, head_dim(src)
    d_out = rope_dim or d_r
    if src.qk_nope_head_dim != d_h:
        raise ValueError("format='deepseek_v3' needs a latent basis (qk_nope_head_dim = head_dim)")
    if d_out < d_r or d_out % 2:
        raise ValueError(f"rope_dim={d_out}: the export's RoPE dims must be even and >= the conversion's {d_r}")
    n, n_out = d_r // 2, d_out // 2
    # rotate_half order (first halves, then second halves) -> interleaved pairs; -1: a zero row (pair beyond d_r)
    interleave = [i for j in range(n_out) for i in ((j, j + n) if j < n else (-1, -1))]
    per_head = list(range(d_h)) + [d_h + i if i >= 0 else -1 for i in interleave]  # [q_nope | q_rope] of a head
    q_index = [h * (d_h + d_r) + i if i >= 0 else -1 for h in range(src.num_attention_heads) for i in per_head]
    kv_index = list(range(d_c)) + [d_c + i if i >= 0 else -1 for i in interleave]
    # query LoRA: linear as the latent norm (ms(u) < 1 for every token, so q_in^2 <= LINEAR_MARGIN eps bounds it),
    # or renormalizing at Q_SCALE ("fit": fp16)
    q_in = Q_SCALE if latent_norm == "fit" else 2.0 ** math.floor(0.5 * math.log2(LINEAR_MARGIN * EXPORT_EPS))
    q_gain = 1.0 if latent_norm == "fit" else math.sqrt(EXPORT_EPS) / q_in
    return ExportShape(
        d_r,
        d_c,
        d_h,
        d_out,
        src.hidden_size,
        q_index,
        kv_index,
        math.sqrt((d_h + d_out) / (d_h + d_r)),
        math.sqrt(EXPORT_EPS / src.rms_norm_eps),
        q_in,
        q_gain,
        engine == "llama.cpp",
        latent_norm,
    )


def export_config(src, source_config, shape: ExportShape, stride: int):
    """(DeepseekV3Config, rope report): the stock config of the export (dense MLP in every layer, no MoE)."""
    from transformers import DeepseekV3Config

    n, n_out = shape.d_r // 2, shape.d_out // 2
    theta, rope_report = stock_rope_theta(source_config, [j * stride for j in range(n)], n_out)
    config = DeepseekV3Config(
        vocab_size=src.vocab_size,
        hidden_size=src.hidden_size,
        intermediate_size=src.intermediate_size,
        moe_intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_attention_heads,
        n_shared_experts=1,
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_group=None,
        topk_group=None,
        first_k_dense_replace=src.num_hidden_layers,
        routed_scaling_factor=1.0,
        kv_lora_rank=shape.d_c,
        q_lora_rank=src.hidden_size if shape.q_lora else None,
        qk_rope_head_dim=shape.d_out,
        qk_nope_head_dim=shape.d_h,
        v_head_dim=shape.d_h,
        hidden_act=src.hidden_act,
        max_position_embeddings=src.max_position_embeddings,
        initializer_range=src.initializer_range,
        rms_norm_eps=EXPORT_EPS,
        pad_token_id=src.pad_token_id,
        bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id,
        tie_word_embeddings=False,  # an lm_head of its own: engines differ on tied DeepSeek heads
        rope_interleave=True,
        attention_bias=False,
        num_mtp_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        architectures=["DeepseekV3ForCausalLM"],
    )
    return config, {"theta": theta, **rope_report}


class LatentStats:
    """One layer's latent statistics: add(kv_a_proj output [..., d_c + d_r]) token batch by batch; then `scale()`:
    (s, M, deviation). linear: s the largest power of two with max_t ms(s c_t) <= LINEAR_MARGIN * EXPORT_EPS,
    deviation 1 - (1 + s^2 max ms / eps)^(-1/2); fit: s the power of two nearest LATENT_RMS / rms(c),
    M = E[c c^T / r] E[c c^T / r^2]^-1 (r = rms(c), no eps), deviation None."""

    def __init__(self, d_c: int, mode: str):
        self.d_c, self.mode = d_c, mode
        self.cross, self.gram, self.total, self.count, self.ms_max = 0.0, 0.0, 0.0, 0, 0.0

    def add(self, output: torch.Tensor) -> None:
        c = output[..., : self.d_c].reshape(-1, self.d_c).double().cpu()
        ms = c.pow(2).mean(-1, keepdim=True)
        self.total += float(ms.sum())
        self.count += len(c)
        self.ms_max = max(self.ms_max, float(ms.max()))
        if self.mode == "fit":
            normed = c / ms.sqrt().clamp_min(1e-30)
            self.cross = self.cross + c.t() @ normed
            self.gram = self.gram + normed.t() @ normed

    def scale(self) -> tuple[float, torch.Tensor | None, float | None]:
        if self.mode == "linear":
            s = 2.0 ** math.floor(0.5 * math.log2(LINEAR_MARGIN * EXPORT_EPS / max(self.ms_max, 1e-300)))
            return s, None, 1 - (1 + s * s * self.ms_max / EXPORT_EPS) ** -0.5
        ridge = 1e-9 * torch.trace(self.gram) / self.d_c * torch.eye(self.d_c, dtype=torch.float64)
        rms = max(self.total / self.count, 1e-30) ** 0.5
        return (
            float(2.0 ** round(math.log2(LATENT_RMS / rms))),
            torch.linalg.solve(self.gram + ridge, self.cross.t()).t(),
            None,
        )


def export_layer(state: dict, layer: int, shape: ExportShape, scale: float, latent_map) -> dict:
    """Layer `layer`'s tensors of `state` (full names, native MLA) rewritten in place into the export's; returns
    the same layer's tensors of the export with a plain q_proj (the query LoRA's KL reference; llama.cpp only)."""
    prefix = f"model.layers.{layer}."
    attn, k, d_c = prefix + "self_attn.", shape.k, shape.d_c
    dtype = state[attn + "q_proj.weight"].dtype
    state[attn + "o_proj.weight"] = state[attn + "o_proj.weight"] * k
    state[prefix + "mlp.down_proj.weight"] = state[prefix + "mlp.down_proj.weight"] * k
    g = state[prefix + "input_layernorm.weight"].double()
    w_q = _rows(state.pop(attn + "q_proj.weight"), shape.q_index) * shape.q_rescale
    kv_a = _rows(state[attn + "kv_a_proj_with_mqa.weight"], shape.kv_index).double()
    kv_a[:d_c] *= scale
    if shape.latent_norm == "linear":  # g s c / sqrt(eps) = c: the native up-projection unchanged
        state[attn + "kv_a_layernorm.weight"] = torch.full((d_c,), math.sqrt(EXPORT_EPS) / scale, dtype=dtype)
    else:  # c / rms(c) through the fitted map
        state[attn + "kv_a_layernorm.weight"] = torch.ones(d_c, dtype=dtype)
        state[attn + "kv_b_proj.weight"] = (state[attn + "kv_b_proj.weight"].double() @ latent_map).to(dtype)
    if not shape.q_lora:
        state[attn + "q_proj.weight"] = w_q
        state[attn + "kv_a_proj_with_mqa.weight"] = kv_a.to(dtype)
        return {}
    q_proj_state = {
        attn + "q_proj.weight": w_q,
        attn + "kv_a_proj_with_mqa.weight": kv_a.to(dtype),
        prefix + "input_layernorm.weight": g.to(dtype),
    }
    state[attn + "kv_a_proj_with_mqa.weight"] = (kv_a * g).to(dtype)  # input_layernorm's weight moved in
    state[prefix + "input_layernorm.weight"] = torch.ones_like(state[prefix + "input_layernorm.weight"])
    state[attn + "q_a_proj.weight"] = (shape.q_in * torch.eye(shape.hidden)).to(dtype)
    state[attn + "q_a_layernorm.weight"] = (g * shape.q_gain).to(dtype)
    state[attn + "q_b_proj.weight"] = w_q
    return q_proj_state


def export_resident(state: dict, shape: ExportShape) -> None:
    """The embeddings times the residual scale k (in place); the LM head a tensor of its own."""
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * shape.k
    state["lm_head.weight"] = state["lm_head.weight"].clone()


def _rows(weight: torch.Tensor, index: list[int]) -> torch.Tensor:
    """weight[index] with zero rows where index is -1."""
    out = weight.new_zeros(len(index), *weight.shape[1:])
    keep = torch.tensor([i >= 0 for i in index])
    out[keep] = weight[torch.tensor([i for i in index if i >= 0], dtype=torch.long)]
    return out
