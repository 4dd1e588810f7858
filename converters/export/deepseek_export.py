"""`--format deepseek_v3`: an MLA conversion as a stock `DeepseekV3ForCausalLM` (no custom code; vLLM/SGLang serve it).

What a stock DeepSeek-V3 config cannot say, and how the export handles it:
- RoPE frequencies. Stock pair j of the d_r-dim key turns at theta'^(-2j/d_r); a llama source's pair i at
  theta^(-2i/d_rot). With theta' = theta^(s d_r / d_rot) stock pair j is source pair j*s exactly, so the shared key
  keeps one component at each of the frequencies 0, s, 2s, ... (the stride s with the most RoPE score over all
  layers). Same weights, no approximation. An engine shape with more RoPE dims than the source has frequencies
  (d_r 64, d_rot 48) gets zero rows for the pairs beyond them, and queries times sqrt(qk_head_dim ratio) (the
  softmax scale counts the zero dims). A llama3-scaled source (rope_type "llama3") is exact
  when every kept frequency lies in the band the scaling leaves unchanged; otherwise theta' is the least-squares fit
  of the kept log-frequencies, and the largest relative frequency error is reported.
- Interleaved RoPE. vLLM and SGLang rotate DeepSeek's rope dims as interleaved pairs (x0, x1), (x2, x3), ...
  (`rope_interleave=True`); our rotate_half rows are permuted into that order. Exact.
- The norms' eps. transformers hard-codes eps 1e-6 in kv_a_layernorm and q_a_layernorm, llama.cpp and vLLM read
  rms_norm_eps for every norm: the export's rms_norm_eps is EXPORT_EPS = 1e-6 so all engines agree. The source's
  other norms had eps e: the residual stream is scaled by k = sqrt(1e-6 / e) (embeddings, o_proj and down_proj
  times k), and RMSNorm(k h; k^2 e) = RMSNorm(h; e), so the eps change is exact (the final norm hides k from lm_head).
- The latent norm ("linear", fp32 / bf16). Stock DeepSeek always computes kv_a_layernorm(c) = g c / sqrt(ms(c) + eps).
  The latent rows of kv_a_proj are scaled by a power of two s so that ms(s c) <= LINEAR_MARGIN eps on every
  calibration token; then the norm is linear, g s c / sqrt(eps) (1 + ms(s c) / eps)^(-1/2), and g = sqrt(eps) / s
  gives back c up to a relative 2^-31 (the cache holds the normalized latent, at its usual scale). fp32 and bf16
  have the range for s c (~1e-8 to 1e-12); fp16 does not (subnormal below 6e-5), nor GGUF f16 weights or
  quantizations with fp16 block scales: convert to GGUF with --outtype f32 or bf16.
- The latent norm ("fit", fp16 exports). The latent is scaled to rms ~LATENT_RMS (eps negligible) and kv_b_proj
  absorbs the least-squares map M = E[c c^T / r] E[c c^T / r^2]^-1, so kv_b(c / r) ~ kv_b_native(c): approximate,
  the report gives KL(native || deepseek_v3) per token.
- The query LoRA (llama.cpp exports only). llama.cpp reads deepseek2.attention.q_lora_rank from every DeepSeek GGUF
  whose layer count is not a known "lite" one (26, 27); so an export for llama.cpp has one of rank hidden_size:
  input_layernorm's weight g moves into kv_a_proj (columns) and q_a_layernorm, and q_a_proj = t I with t a power
  of two, t^2 <= LINEAR_MARGIN eps: q_a_layernorm sees t u with u = h / rms_eps(h), ms(u) < 1, so it is linear too,
  and its weight g sqrt(eps) / t gives back g u, the source's normalized input (exact up to 2^-31). In fp16 ("fit")
  t = Q_SCALE and the norm renormalizes: W_q x up to a factor sqrt(1 + eps / ms(h)) per token. The report gives
  its KL and its extra parameters, hidden^2 + hidden per layer. Other engines get a plain q_proj (q_lora_rank null).
- Engine shapes (ENGINE_SHAPES): kv_lora_rank + qk_rope_head_dim = 512 + 64 or 256 + 64 for vLLM and SGLang, 512 + 64
  for FlashMLA. vLLM runs MLA for every DeepSeek config (no expanded fallback): which of its backends take a shape
  is vllm_backends.py; its CPU build (CPU_MLA) takes 512 + 64 only.
- No MoE: first_k_dense_replace = number of layers builds a dense MLP (gate/up/down, as llama's) in every layer;
  n_routed_experts stays an integer (1) because transformers 5.23 rejects null, and n_group / topk_group are null
  (llama.cpp asserts n_expert_groups < n_expert, and a dense model has no expert groups). num_key_value_heads =
  heads.
- Sources: llama-family layers without attention / MLP biases (vLLM and llama.cpp build DeepSeek's projections
  without biases; a query bias adds q-dependent terms no stock weight can hold), without sliding windows and
  without per-head q/k norms (the norm sits between W_k and RoPE, on every head's key: one shared RoPE key cannot
  carry it).
"""

from __future__ import annotations

import logging
import math

import torch

from ...models.architectures import head_dim, rotary_dim
from .constants import (
    ENGINE_SHAPES,
    ENGINES,
    EXPORT_EPS,
    LATENT_NORMS,
    QK_NORM_TYPES,
    ROPE_TYPES,
    RUN_HERE,
    SOURCE_TYPES,
)
from .deepseek_layers import LatentStats, export_config, export_layer, export_resident, export_shape
from .vllm_backends import VLLM_CPU_SHAPES, vllm_backends, vllm_shape_names, vllm_support

logger = logging.getLogger(__name__)


def check_source(config, rope_dim: int | None = None) -> None:
    """Raise (naming the field) unless the source's layers map 1:1 onto stock DeepSeek-V3 ones and rope_dim gives
    one component to each of 1 .. d_rot/2 distinct frequencies (None: the sizes are not known yet)."""
    if config.model_type in QK_NORM_TYPES:
        raise ValueError(
            f"format='deepseek_v3': model_type {config.model_type!r} has per-head q/k norms (QK-norm); "
            "each head's key is normalized after W_k and before RoPE, a per-token, per-head division "
            "that one shared latent and one shared RoPE key cannot carry: use format='native'"
        )
    if config.model_type not in SOURCE_TYPES:
        raise ValueError(f"format='deepseek_v3' needs a llama-family source {SOURCE_TYPES}, not {config.model_type!r}")
    if config.model_type == "qwen2":  # q/k/v biases always: the query bias has no place in a stock layer
        raise ValueError(
            "format='deepseek_v3': model_type 'qwen2' has q/k/v biases; a query bias adds q-dependent "
            "terms to every score that no bias-free stock DeepSeek-V3 weight can hold (vLLM and "
            "llama.cpp build its projections without biases): use format='native'"
        )
    for field in ("attention_bias", "mlp_bias"):
        if getattr(config, field, False):
            raise ValueError(f"format='deepseek_v3': {field}=True has no place in a stock DeepSeek-V3 layer")
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(f"format='deepseek_v3': sliding_window={config.sliding_window} is not in DeepSeek-V3")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"format='deepseek_v3' takes rope_type {ROPE_TYPES}; the source has rope_type={rope_type!r}")
    if rope_dim is not None:
        half = rotary_dim(config) // 2
        if not 1 <= rope_dim // 2 <= half:
            raise ValueError(
                f"rope_dim={rope_dim}: format='deepseek_v3' keeps one component per frequency, 1..{half} of them"
            )


def engine_shape(
    engine: str, config, kv_budget: float | None, kv_lora_rank: int | None, rope_dim: int | None
) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of `engine`'s MLA kernels for this source and budget (the largest that
    fits), or None when the engine takes any shape. Raises, naming the budgets that would fit, when none does."""
    shapes = ENGINE_SHAPES[engine]
    if shapes is None:
        return None
    if engine == "vllm":
        names = vllm_shape_names(shapes)
    else:
        names = " or ".join(f"{c} + {r}" for c, r in shapes)
    d_h = head_dim(config)
    values = 2 * (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * d_h
    rank_cap = min(values, config.hidden_size)  # a latent spans at most the stacked [K; V] rows and the input dims
    usable = [(c, r) for c, r in shapes if c + r <= values and c <= rank_cap]
    if not usable:
        raise ValueError(
            f"engine={engine!r} runs MLA only with kv_lora_rank + qk_rope_head_dim = {names}; the "
            f"source has {values} KV values per token per layer (hidden_size {config.hidden_size}), too "
            f"few for any of them: use engine='llama.cpp' or 'transformers' (any shape)"
        )
    fits = ", ".join(f"kv_budget >= {math.ceil((c + r) / values * 1000) / 1000} ({c} + {r})" for c, r in usable)
    if rope_dim is not None and rope_dim not in {r for _, r in usable}:
        raise ValueError(f"rope_dim={rope_dim}: engine={engine!r} runs MLA only with {names}")
    if kv_lora_rank is not None:
        if kv_lora_rank not in {c for c, _ in usable}:
            raise ValueError(
                f"kv_lora_rank={kv_lora_rank}: engine={engine!r} runs MLA only with {names}; for this source: {fits}"
            )
        return next((c, r) for c, r in usable if c == kv_lora_rank)
    budget = int(round(kv_budget * values))
    for c, r in usable:
        if c + r <= budget:
            if engine == "vllm" and (c, r) not in VLLM_CPU_SHAPES:
                logger.warning(
                    "engine='vllm': %d + %d runs on vLLM's GPU backends only (%s); vLLM's CPU build "
                    "takes 512 + 64 only",
                    c,
                    r,
                    ", ".join(vllm_backends(c, r, limited=True)),
                )
            return c, r
    raise ValueError(
        f"kv_budget={kv_budget} gives {budget} of {values} KV values per token per layer: engine="
        f"{engine!r} runs MLA only with {names}; this source fits {fits}"
    )


def engine_support(kv_lora_rank: int, rope_dim: int, q_lora: bool, num_layers: int) -> dict[str, dict]:
    """Per engine: whether an export of this shape runs on its MLA kernels (a latent cache) or falls back to full
    attention, and whether that was run here or read from the engine's constraints."""
    out = {}
    for engine in ENGINES:
        shapes = ENGINE_SHAPES[engine]
        if engine == "llama.cpp" and not q_lora and num_layers not in (26, 27):
            status = (
                "refuses to load: llama.cpp needs q_lora_rank for this layer count (export with engine='llama.cpp')"
            )
        elif engine == "transformers":
            status = (
                "runs (stock DeepseekV3ForCausalLM caches the latent, re-expanded every step; with "
                "hf_attn_patch imported, absorbed MLA decode)"
            )
        elif engine == "vllm":
            out[engine] = vllm_support(kv_lora_rank, rope_dim)
            continue
        elif shapes is None or (kv_lora_rank, rope_dim) in shapes:
            status = "MLA kernels (latent cache)"
        else:
            status = (
                f"falls back to expanded attention (no KV memory saved): its MLA kernels take "
                f"{' or '.join(f'{c} + {r}' for c, r in shapes)}, not {kv_lora_rank} + {rope_dim}"
            )
        out[engine] = {
            "status": status,
            "evidence": "run here"
            if engine in RUN_HERE
            else "read from the engine's constraints (not installable here)",
        }
    return out


def to_deepseek_v3(
    native,
    windows: torch.Tensor,
    stride: int,
    source_config=None,
    engine: str = "llama.cpp",
    rope_dim: int | None = None,
    latent_norm: str = "linear",
) -> tuple[torch.nn.Module, dict]:
    """(stock DeepseekV3ForCausalLM, report) from a whole native MLA model whose every layer keeps frequencies
    0, s, ... (the streamed conversion builds the same tensors layer by layer: stages/export.py).

    windows: calibration token windows [n, L] for the latent scale / fit and the KL to the native model.
    source_config: the source's config (its rope parameters; default native.config). rope_dim: the export's RoPE
    dims (>= the native one: zero pairs beyond it). latent_norm: "linear" (fp32 / bf16) or "fit" (module docstring)."""
    from transformers import AutoModelForCausalLM

    from ...evaluation.perplexity import evaluate

    check_export(engine, latent_norm)
    src = native.config
    shape = export_shape(src, engine, rope_dim, latent_norm)
    config, rope = export_config(src, source_config or src, shape, stride)
    model = AutoModelForCausalLM.from_config(config, dtype=next(native.parameters()).dtype)
    state = {k: v.cpu() for k, v in native.state_dict().items()}  # the export is built on the CPU
    stats = [LatentStats(shape.d_c, latent_norm) for _ in range(src.num_hidden_layers)]
    handles = [
        layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, a, out, s=s: s.add(out))
        for layer, s in zip(native.model.layers, stats)
    ]
    try:
        with torch.no_grad():
            for window in windows:  # one window at a time
                native(window[None].to(native.device))
    finally:
        for h in handles:
            h.remove()
    scales, q_proj_state, deviations = [], {}, []
    export_resident(state, shape)
    for layer, layer_stats in enumerate(stats):
        scale, latent_map, deviation = layer_stats.scale()
        scales.append(scale)
        deviations.append(deviation)
        q_proj_state.update(export_layer(state, layer, shape, scale, latent_map))
    model.load_state_dict(state, strict=True)
    model.generation_config = native.generation_config
    model.eval()
    check = windows[: min(4, len(windows))]
    kl = evaluate(model, check, reference=native, progress=False).kl_to_reference
    q_lora_kl = (
        evaluate(model, check, reference=_with_q_proj(model, state, q_proj_state), progress=False).kl_to_reference
        if shape.q_lora
        else None
    )
    report = export_report(
        shape,
        src,
        engine,
        stride,
        rope,
        scales,
        deviations,
        kl,
        len(check),
        q_lora_kl,
        sum(p.numel() for p in native.parameters()),
    )
    logger.info(
        "deepseek_v3 export (%s, latent norm %s): KL to the native conversion %.3g per token", engine, latent_norm, kl
    )
    return model, report


def check_export(engine: str, latent_norm: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is not one of {ENGINES}")
    if latent_norm not in LATENT_NORMS:
        raise ValueError(f"latent_norm={latent_norm!r} is not one of {LATENT_NORMS}")


def export_report(
    shape,
    src,
    engine: str,
    stride: int,
    rope: dict,
    scales: list,
    deviations: list,
    kl: float,
    kl_windows: int,
    q_lora_kl: float | None,
    native_parameters: int,
) -> dict:
    """The report's "deepseek_v3" section."""
    latent_norm = shape.latent_norm
    rope_report = {k: v for k, v in rope.items() if k != "theta"}
    n = shape.d_r // 2
    report = {
        "exact": latent_norm == "linear" and rope_report["exact"],
        "latent_norm": {
            "mode": latent_norm,
            "why": (
                "the latent scaled so that kv_a_layernorm is linear (fp32 / bf16 only: the scaled latent is "
                "subnormal in fp16; GGUF: --outtype f32 or bf16)"
                if latent_norm == "linear"
                else "fp16: what follows kv_a_layernorm fitted by least squares (approximate)"
            ),
            "scale_per_layer": scales,
            "max_relative_deviation_calibration": max(deviations) if latent_norm == "linear" else None,
        },
        "eps": {"source": src.rms_norm_eps, "export": EXPORT_EPS, "residual_scale": shape.k},
        "kl_to_native_per_token": kl,
        "kl_windows": kl_windows,
        "engine": engine,
        "shape": {"kv_lora_rank": shape.d_c, "qk_rope_head_dim": shape.d_out, "rope_pairs_used": n},
        "engines": engine_support(shape.d_c, shape.d_out, shape.q_lora, src.num_hidden_layers),
        "rope_frequencies": [j * stride for j in range(n)],
        "rope_theta": rope["theta"],
        "rope": rope_report,
    }
    if shape.q_lora:
        extra = src.num_hidden_layers * (src.hidden_size**2 + src.hidden_size)  # q_a_proj + q_a_layernorm per layer
        report["q_lora"] = {
            "rank": src.hidden_size,
            "why": "llama.cpp needs deepseek2.attention.q_lora_rank for non-lite layer counts",
            "extra_parameters": extra,
            "extra_fraction_of_model": extra / native_parameters,
            "kl_to_q_proj_per_token": q_lora_kl,
        }
    return report


def _with_q_proj(model, state: dict, q_proj_state: dict):
    """The export with a plain q_proj (q_lora_rank None) and input_layernorm's weight back in place: KL reference."""
    from transformers import AutoModelForCausalLM

    config = model.config.to_dict()
    config["q_lora_rank"] = None
    plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=model.dtype)
    plain_state = {k: v for k, v in state.items() if ".q_a_" not in k and ".q_b_" not in k}
    plain_state.update(q_proj_state)
    plain.load_state_dict(plain_state, strict=True)
    return plain.eval()
