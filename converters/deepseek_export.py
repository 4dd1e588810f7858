"""`--format deepseek_v3`: an MLA conversion as a stock `DeepseekV3ForCausalLM` (no custom code; vLLM/SGLang serve it).

What a stock DeepSeek-V3 config cannot say, and how the export handles it:
- RoPE frequencies. Stock pair j of the d_r-dim key turns at theta'^(-2j/d_r); a llama source's pair i at
  theta^(-2i/d_rot). With theta' = theta^(s d_r / d_rot) stock pair j is source pair j*s exactly, so the shared key
  keeps one component at each of the frequencies 0, s, 2s, ... (the stride s with the most RoPE score over all
  layers). Same weights, no approximation.
- Interleaved RoPE. vLLM and SGLang rotate DeepSeek's rope dims as interleaved pairs (x0, x1), (x2, x3), ...
  (`rope_interleave=True`); our rotate_half rows are permuted into that order. Exact.
- The latent norm. Stock DeepSeek always computes kv_a_layernorm(c) = g * c / rms(c), which a linear conversion
  cannot reproduce: 1/rms(c_t) changes from token to token. The export keeps the norm and fits what follows it by
  least squares on the calibration tokens (next item). This is approximate: the report gives KL(native ||
  deepseek_v3) per token, and healing (--heal-steps) trains with the norm in place.
- The latent map: rather than a per-dim norm weight, the norm weight is 1 and kv_b_proj absorbs the least-squares map
  M = E[c c^T / r] E[c c^T / r^2]^-1, so kv_b(c / r) ~ kv_b_native(c) (a full d_c x d_c fit, not only a scale).
- The latent scale: the latent rows of kv_a_proj are multiplied by a power of two s that brings rms(c) to about
  LATENT_RMS, so the norm's eps (1e-6 in transformers, rms_norm_eps in llama.cpp and vLLM) is below fp32 noise
  there (eps / (s^2 ms(c)) < 1e-8): every engine then computes the same c / rms(c), the map M is fitted to.
- The query LoRA. llama.cpp reads deepseek2.attention.q_lora_rank from every DeepSeek GGUF whose layer count is
  not a known "lite" one (26, 27), and its converter writes that key only for a non-null q_lora_rank; so the
  export has one of rank hidden_size: input_layernorm's weight g moves into kv_a_proj (columns) and
  q_a_layernorm, and q_a_proj = Q_SCALE * I. The query is then q_b(g * u / rms(u)) with u = h / rms_eps(h) the
  normalized residual, rms(u)^2 = ms(h) / (ms(h) + eps): W_q x up to a factor sqrt(1 + eps / ms(h)) per token
  (near-exact; its KL and its extra parameters, hidden^2 + hidden per layer, are in the report).
- No MoE: first_k_dense_replace = number of layers builds a dense MLP (gate/up/down, as llama's) in every layer;
  n_routed_experts stays an integer (1) because transformers 5.23 rejects null, and n_group / topk_group are null
  (llama.cpp asserts n_expert_groups < n_expert, and a dense model has no expert groups). num_key_value_heads =
  heads.
"""

from __future__ import annotations

import logging
import math

import torch

from ..models.architectures import head_dim, rotary_dim

logger = logging.getLogger(__name__)

SOURCE_TYPES = ("llama", "mistral")  # llama-family layers: RMSNorm, gated MLP, no attention biases
LATENT_RMS = 32.0  # target rms of the scaled latent (module docstring); fp16-safe, eps / 32^2 ~ 1e-8
Q_SCALE = 32.0  # q_a_proj = Q_SCALE * I: rms(u) ~ 1, so the query latent's rms is ~32 too
# vLLM's FlashMLA decode kernel (the fast MLA path) takes only these latent / RoPE sizes (DeepSeek-V2/V3's).
FLASHMLA_KV_LORA_RANK, FLASHMLA_ROPE_DIM = 512, 64


def flashmla_fit(kv_lora_rank: int, rope_dim: int) -> dict:
    """Whether an export's ranks fit vLLM's FlashMLA kernel (kv_lora_rank 512 and qk_rope_head_dim 64 only)."""
    fits = kv_lora_rank == FLASHMLA_KV_LORA_RANK and rope_dim == FLASHMLA_ROPE_DIM
    return {"fits": fits, "kv_lora_rank": kv_lora_rank, "qk_rope_head_dim": rope_dim,
            "needs": {"kv_lora_rank": FLASHMLA_KV_LORA_RANK, "qk_rope_head_dim": FLASHMLA_ROPE_DIM}}  # fmt: skip


def check_source(config, rope_dim: int) -> None:
    """Raise (naming the field) unless the source's non-attention layers map 1:1 onto stock DeepSeek-V3 ones and
    rope_dim gives one component to each of 1 .. d_rot/2 distinct frequencies."""
    if config.model_type not in SOURCE_TYPES:
        raise ValueError(f"format='deepseek_v3' needs a llama-family source {SOURCE_TYPES}, not {config.model_type!r}")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(config, field, False):
            raise ValueError(f"format='deepseek_v3': {field}=True has no place in a stock DeepSeek-V3 layer")
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(f"format='deepseek_v3': sliding_window={config.sliding_window} is not in DeepSeek-V3")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"format='deepseek_v3' needs plain RoPE; the source has rope_type={rope_type!r}")
    half = rotary_dim(config) // 2
    if not 1 <= rope_dim // 2 <= half:
        raise ValueError(f"rope_dim={rope_dim}: format='deepseek_v3' keeps one component per frequency, 1..{half} of them")


def stock_frequencies(ranked_per_layer: list[list], half: int, n: int) -> tuple[list[int], int]:
    """(frequencies 0, s, ..., (n-1)s; s) maximizing the summed score of each layer's best component per frequency.

    ranked_per_layer: every layer's (score, RopeComponent) list, best first (methods.ranked_components)."""
    scores = torch.zeros(half, dtype=torch.float64)
    for ranked in ranked_per_layer:
        best = {}
        for score, comp in ranked:
            best.setdefault(comp.freq, score)  # ranked best first
        scores += torch.tensor([best.get(i, 0.0) for i in range(half)], dtype=torch.float64)
    strides = range(1, (half - 1) // (n - 1) + 1) if n > 1 else [1]
    best = max(strides, key=lambda s: float(scores[[j * s for j in range(n)]].sum()))
    return [j * best for j in range(n)], best


def to_deepseek_v3(native, windows: torch.Tensor, stride: int) -> tuple[torch.nn.Module, dict]:
    """(stock DeepseekV3ForCausalLM, report) from a native MLA model whose every layer keeps frequencies 0, s, ...

    windows: calibration token windows [n, L] for the latent-norm fit and the KL to the native model."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from .evaluate import evaluate

    src = native.config
    d_r, d_c, d_h = src.qk_rope_head_dim, src.kv_lora_rank, head_dim(src)
    if src.qk_nope_head_dim != d_h:
        raise ValueError("format='deepseek_v3' needs a latent basis (qk_nope_head_dim = head_dim)")
    config = DeepseekV3Config(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
        moe_intermediate_size=src.intermediate_size, num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads, num_key_value_heads=src.num_attention_heads,
        n_shared_experts=1, n_routed_experts=1, num_experts_per_tok=1, n_group=None, topk_group=None,
        first_k_dense_replace=src.num_hidden_layers, routed_scaling_factor=1.0,
        kv_lora_rank=d_c, q_lora_rank=src.hidden_size, qk_rope_head_dim=d_r, qk_nope_head_dim=d_h, v_head_dim=d_h,
        hidden_act=src.hidden_act, max_position_embeddings=src.max_position_embeddings,
        initializer_range=src.initializer_range, rms_norm_eps=src.rms_norm_eps,
        pad_token_id=src.pad_token_id, bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id,
        tie_word_embeddings=False,  # an lm_head of its own: engines differ on tied DeepSeek heads
        rope_interleave=True, attention_bias=False, num_mtp_layers=0,
        rope_parameters={"rope_type": "default",
                         "rope_theta": src.rope_parameters["rope_theta"] ** (stride * d_r / rotary_dim(src))},
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=next(native.parameters()).dtype)
    state = {k: v.cpu() for k, v in native.state_dict().items()}  # the export is built on the CPU
    heads, n = src.num_attention_heads, d_r // 2
    interleave = [i for j in range(n) for i in (j, j + n)]  # rotate_half order -> (x0, x1), (x2, x3), ...
    per_head = list(range(d_h)) + [d_h + i for i in interleave]  # [q_nope | q_rope] of each head
    q_order = torch.tensor([h * (d_h + d_r) + i for h in range(heads) for i in per_head])
    kv_order = torch.tensor(list(range(d_c)) + [d_c + i for i in interleave])
    maps, scales = latent_norm_maps(native, windows)
    q_proj_state = {}  # the same export with a plain q_proj, to measure what the query LoRA costs
    for layer in range(src.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        attn = prefix + "self_attn."
        dtype = state[attn + "q_proj.weight"].dtype
        g = state[prefix + "input_layernorm.weight"].double()
        w_q = state.pop(attn + "q_proj.weight")[q_order]
        q_proj_state[attn + "q_proj.weight"] = w_q
        kv_a = state[attn + "kv_a_proj_with_mqa.weight"][kv_order].double()
        kv_a[:d_c] *= scales[layer]  # rms(c) ~ LATENT_RMS: the norm's eps no longer matters
        q_proj_state[attn + "kv_a_proj_with_mqa.weight"] = kv_a.to(dtype)
        state[attn + "kv_a_proj_with_mqa.weight"] = (kv_a * g).to(dtype)  # input_layernorm's weight moved in
        state[prefix + "input_layernorm.weight"] = torch.ones_like(state[prefix + "input_layernorm.weight"])
        state[attn + "q_a_proj.weight"] = (Q_SCALE * torch.eye(src.hidden_size)).to(dtype)
        state[attn + "q_a_layernorm.weight"] = g.to(dtype)
        state[attn + "q_b_proj.weight"] = w_q
        state[attn + "kv_a_layernorm.weight"] = torch.ones(d_c, dtype=dtype)
        state[attn + "kv_b_proj.weight"] = (state[attn + "kv_b_proj.weight"].double() @ maps[layer]).to(dtype)
    model.load_state_dict(state, strict=True)
    model.generation_config = native.generation_config
    model.eval()
    check = windows[: min(4, len(windows))]
    kl = evaluate(model, check, reference=native, progress=False).kl_to_reference
    q_lora_kl = evaluate(model, check, reference=_with_q_proj(model, state, q_proj_state),
                         progress=False).kl_to_reference  # fmt: skip
    extra = src.num_hidden_layers * (src.hidden_size**2 + src.hidden_size)  # q_a_proj + q_a_layernorm per layer
    report = {
        "exact": False,
        "why": "stock DeepSeek-V3 applies kv_a_layernorm to the latent; what follows it is fitted by least squares",
        "kl_to_native_per_token": kl,
        "kl_windows": len(check),
        "rope_frequencies": [j * stride for j in range(n)],
        "rope_theta": config.rope_parameters["rope_theta"],
        "latent_scale_per_layer": scales,
        "q_lora": {
            "rank": src.hidden_size,
            "why": "llama.cpp needs deepseek2.attention.q_lora_rank for non-lite layer counts",
            "extra_parameters": extra,
            "extra_fraction_of_model": extra / sum(p.numel() for p in native.parameters()),
            "kl_to_q_proj_per_token": q_lora_kl,
        },
        "flashmla": flashmla_fit(d_c, d_r),
    }
    logger.info("deepseek_v3 export: KL to the native conversion %.4f per token", kl)
    return model, report


def _with_q_proj(model, state: dict, q_proj_state: dict):
    """The export with a plain q_proj (q_lora_rank None) and input_layernorm's weight back in place: KL reference."""
    from transformers import AutoModelForCausalLM

    config = model.config.to_dict()
    config["q_lora_rank"] = None
    plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=model.dtype)
    plain_state = {k: v for k, v in state.items() if ".q_a_" not in k and ".q_b_" not in k}
    plain_state.update(q_proj_state)
    for key in [k for k in state if k.endswith("q_a_layernorm.weight")]:
        plain_state[key.replace("self_attn.q_a_layernorm", "input_layernorm")] = state[key]
    plain.load_state_dict(plain_state, strict=True)
    return plain.eval()


@torch.no_grad()
def latent_norm_maps(native, windows: torch.Tensor) -> tuple[list[torch.Tensor], list[float]]:
    """Per layer (M [d_c, d_c], s): M minimizes sum_t ||c_t - M c_t / r_t||^2 over the calibration tokens with
    r = rms(c) (no eps: the scaled latent s c makes eps negligible), M = E[c c^T / r] E[c c^T / r^2]^-1; s is the power
    of two closest to LATENT_RMS / rms of c over the tokens (module docstring)."""
    d_c = native.config.kv_lora_rank
    sums: dict[int, tuple[torch.Tensor, torch.Tensor, float, int]] = {}

    def hook(layer):
        def record(module, args, output):
            c = output[..., :d_c].reshape(-1, d_c).double().cpu()
            ms = c.pow(2).mean(-1, keepdim=True)
            normed = c / ms.sqrt().clamp_min(1e-30)
            cross, gram, total, count = sums.get(layer, (0.0, 0.0, 0.0, 0))
            sums[layer] = (cross + c.t() @ normed, gram + normed.t() @ normed, total + float(ms.sum()), count + len(c))

        return record

    layers = [layer.self_attn for layer in native.model.layers]
    handles = [a.kv_a_proj_with_mqa.register_forward_hook(hook(i)) for i, a in enumerate(layers)]
    try:
        for window in windows:
            native(window[None].to(native.device))
    finally:
        for h in handles:
            h.remove()
    maps, scales = [], []
    for i in range(len(layers)):
        cross, gram, total, count = sums[i]
        ridge = 1e-9 * torch.trace(gram) / d_c * torch.eye(d_c, dtype=torch.float64)
        maps.append(torch.linalg.solve(gram + ridge, cross.t()).t())
        rms = max(total / count, 1e-30) ** 0.5
        scales.append(float(2.0 ** round(math.log2(LATENT_RMS / rms))))
    return maps, scales
