"""RoPE helpers against transformers' own functions and against the math."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rope

from hf_attn_patch.attention.rope import apply_rope, deinterleave, select_rope_pairs


def cos_sin(d_rot: int, length: int = 5, theta: float = 10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, d_rot, 2).float() / d_rot)
    freqs = torch.arange(length).float()[None, :, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def test_partial_rope_matches_gpt_neox():
    q, k = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    cos, sin = cos_sin(4)
    ref_q, ref_k = neox_rope(q, k, cos, sin)
    assert torch.equal(apply_rope(q, cos, sin), ref_q) and torch.equal(apply_rope(k, cos, sin), ref_k)


def test_deinterleaved_rope_is_bit_identical_to_deepseek_interleaved():
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    cos, sin = cos_sin(8)
    ref_q, ref_k = apply_rotary_pos_emb_interleave(q, k, cos, sin)
    assert torch.equal(apply_rope(deinterleave(q), cos, sin), ref_q)
    assert torch.equal(apply_rope(deinterleave(k), cos, sin), ref_k)


def test_selected_pairs_rotate_like_the_full_rotation_restricted_to_them():
    x = torch.randn(1, 1, 5, 8)  # 4 pairs: (0,4) (1,5) (2,6) (3,7)
    cos, sin = cos_sin(8)
    full = apply_rope(x, cos, sin)
    pairs = torch.tensor([3, 1])
    picked = x[..., [3, 1, 7, 5]]  # those pairs' dims in rotate_half layout
    c, s = select_rope_pairs(cos, sin, pairs)
    # the same two products per element on the same values: equal bit for bit; 1e-7 < eps x |x| allows one rounding
    assert torch.allclose(apply_rope(picked, c, s), full[..., [3, 1, 7, 5]], atol=1e-7)
    c2, _ = select_rope_pairs(cos, sin, torch.tensor([2, 2]))  # repeats allowed: one frequency twice
    assert torch.equal(c2[..., 0], c2[..., 1]) and torch.equal(c2[..., 0], cos[..., 2])
