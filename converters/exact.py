"""Exact re-expression of a stock model with our attention modules: same function, new parameterization.

- GQA: the source's own heads (H_kv = H for MHA sources) in GroupedQueryAttention.
- MLA (TransMLA's observation made exact): the latent is the stacked non-RoPE K and V of all H_kv heads,
  c = [W_K_nope; W_V] x (or, when that has more rows than the hidden size, its full-rank SVD factor), and the
  decoupled RoPE key is the H_kv RoPE'd key heads side by side (d_r = H_kv * d_rot), each query head reading its
  own group's block. Scores and outputs equal the source's up to float rounding; the lossy conversions of the
  converter issue (pooling, truncated SVD, RoPE selection) start from this form.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ..attention import MultiHeadLatentAttention
from ..models.architectures import AttentionWeights, architecture_of, head_dim, rotary_dim


def to_variant(model: nn.Module, variant: str) -> nn.Module:
    """A new model computing the same function as `model` with attention_variant `variant` ("gqa" | "mla").

    The source model is not modified. Needs the patch (import hf_attn_patch) so the new config builds our modules.
    """
    from transformers import AutoModelForCausalLM

    from .. import is_patched

    if not is_patched():
        raise RuntimeError("to_variant needs the patch: call hf_attn_patch.patch() first")
    arch = architecture_of(model.config)
    stock = {name: m for name, m in model.named_modules() if type(m).__name__ == arch.attention_class}
    if not stock and variant == "mla" and arch.replaces_stock:  # built with our module already (DeepSeek-V3)
        stock = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadLatentAttention)}
    if not stock:
        raise ValueError(f"no {arch.attention_class} layers found: is the model already converted?")
    if variant == "gqa":
        lifted = {name: (split := arch.split_heads(m)).gqa_state_dict() for name, m in stock.items()}
        fields = {"num_key_value_heads": split.k_w.shape[0] // head_dim(model.config)}
    elif variant == "mla" and arch.replaces_stock:  # DeepSeek: already MLA, same parameter names
        lifted = {name: m.state_dict() for name, m in stock.items()}
        fields = {}
    elif variant == "mla":
        lifted, fields = {}, None
        for name, m in stock.items():
            lifted[name], fields = _lift_mla(arch.split_heads(m), model.config)
    else:
        raise ValueError(f"variant={variant!r} is not one of ('gqa', 'mla')")

    config = copy.deepcopy(model.config)
    config.attention_variant = variant
    for key, value in fields.items():
        setattr(config, key, value)
    config = type(config).from_dict(config.to_dict())  # rebuild: validates the variant fields
    new = AutoModelForCausalLM.from_config(
        config, dtype=next(model.parameters()).dtype, attn_implementation=model.config._attn_implementation
    )
    state = {k: v for k, v in model.state_dict().items() if not any(k.startswith(n + ".") for n in stock)}
    for name, sd in lifted.items():
        state.update({f"{name}.{k}": v for k, v in sd.items()})
    new.load_state_dict(state, strict=True)
    new.generation_config = copy.deepcopy(model.generation_config)
    return new.eval() if not model.training else new


def _with_bias_column(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[out, in] weight and [out] bias -> [out, in + 1] (zeros when there is no bias), so rows move with their bias."""
    bias = bias if bias is not None else weight.new_zeros(weight.shape[0])
    return torch.cat((weight, bias[:, None]), dim=1)


def _lift_mla(w: AttentionWeights, config) -> tuple[dict[str, torch.Tensor], dict]:
    """Exact MLA parameters (state dict, config fields) for one layer's heads."""
    arch = architecture_of(config)
    d_h, hidden = head_dim(config), w.q_w.shape[1]
    heads, kv_heads = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
    group = heads // kv_heads
    d_rot = rotary_dim(config) if arch.rotary else 0
    half = d_rot // 2
    d_nope, d_r, d_v = d_h - d_rot, kv_heads * d_rot, d_h
    dtype = w.q_w.dtype
    f64 = lambda t: None if t is None else t.to(torch.float64)  # noqa: E731 - exact arithmetic, cast back at the end
    q_w, k_w, v_w, o_w = map(f64, (w.q_w, w.k_w, w.v_w, w.o_w))
    q_b, k_b, v_b, o_b = map(f64, (w.q_b, w.k_b, w.v_b, w.o_b))
    if w.q_norm is not None:
        raise ValueError("exact MLA lift of per-head q/k norms (qwen3) is not possible: the norm is not linear")

    # Queries: per head [q_nope (its non-RoPE dims) ; q_rope (its RoPE dims in its group's block, zeros elsewhere)].
    # MLA scores use 1/sqrt(d_nope + d_r); the source's own scale is folded into the query weights.
    scale = w.scaling * math.sqrt(d_nope + d_r)
    q_new = torch.zeros(heads, d_nope + d_r, hidden + 1, dtype=torch.float64)
    q_aug = _with_bias_column(q_w, q_b).view(heads, d_h, hidden + 1)
    for h in range(heads):
        g = h // group
        q_new[h, :d_nope] = q_aug[h, d_rot:]
        q_new[h, d_nope + g * half : d_nope + (g + 1) * half] = q_aug[h, :half]
        q_new[h, d_nope + d_r // 2 + g * half : d_nope + d_r // 2 + (g + 1) * half] = q_aug[h, half:d_rot]
    q_new = q_new.reshape(-1, hidden + 1) * scale

    # Rope key rows: first halves of every KV head's pairs, then the second halves (rotate_half layout).
    k_aug = _with_bias_column(k_w, k_b).view(kv_heads, d_h, hidden + 1)
    k_rope = torch.cat((k_aug[:, :half].reshape(-1, hidden + 1), k_aug[:, half:d_rot].reshape(-1, hidden + 1)))

    # Latent: stacked [K_nope; V] of the KV heads. A K bias on non-RoPE dims adds q.b to every score of a query:
    # softmax ignores it, so it is dropped. A V bias rides in the latent bias (identity lift) or moves to o_proj.
    stacked_w = torch.cat((k_w.view(kv_heads, d_h, hidden)[:, d_rot:].reshape(-1, hidden), v_w))
    v_bias = v_b if v_b is not None else torch.zeros(v_w.shape[0], dtype=torch.float64)
    rows = stacked_w.shape[0]
    if rows <= hidden:
        down_w, up = stacked_w, torch.eye(rows, dtype=torch.float64)
        down_b = torch.cat((torch.zeros(rows - v_w.shape[0], dtype=torch.float64), v_bias))
        o_extra = None
    else:  # rank(stacked) <= hidden: the full-rank SVD factor is exact
        u, s, vh = torch.linalg.svd(stacked_w, full_matrices=False)
        down_w, up, down_b = s[:, None] * vh, u, torch.zeros(hidden, dtype=torch.float64)
        o_extra = o_w @ v_bias.view(kv_heads, 1, d_h).expand(kv_heads, group, d_h).reshape(-1)
        if o_b is None and bool(v_bias.any()):
            raise ValueError("exact MLA lift: V bias needs an o_proj bias to fold into when K/V rows exceed hidden")
    latent = down_w.shape[0]
    k_rows = rows - v_w.shape[0]
    k_up, v_up = up[:k_rows].view(kv_heads, d_nope, latent), up[k_rows:].view(kv_heads, d_v, latent)
    kv_b = torch.cat((k_up, v_up), dim=1).repeat_interleave(group, dim=0).reshape(-1, latent)

    spec_bias = arch.biases(config)
    state = {
        "q_proj.weight": q_new[:, :hidden],
        "kv_a_proj_with_mqa.weight": torch.cat((down_w, k_rope[:, :hidden])),
        "kv_b_proj.weight": kv_b,
        "o_proj.weight": o_w,
    }
    if spec_bias[0]:
        state["q_proj.bias"] = q_new[:, hidden]
    if spec_bias[1] or spec_bias[2]:
        state["kv_a_proj_with_mqa.bias"] = torch.cat((down_b, k_rope[:, hidden]))
    if spec_bias[3]:
        state["o_proj.bias"] = o_b + (o_extra if o_extra is not None else 0)
    state = {k: v.to(dtype) for k, v in state.items()}
    fields = dict(
        kv_lora_rank=latent,
        qk_nope_head_dim=d_nope,
        qk_rope_head_dim=d_r,
        v_head_dim=d_v,
        q_lora_rank=None,
        mla_latent_norm=False,
        mla_rope_pairs=[i for _ in range(kv_heads) for i in range(half)] if d_r else None,
    )
    return state, fields
