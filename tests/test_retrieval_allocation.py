"""Retrieval-aware rank allocation (converters/stages/retrieval.py, convert(rank_allocation="retrieval")): copy
scores from the source's attention on S + S, the copy layers kept exact within the KV budget."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text
from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.converters.stages import retrieval
from hf_attn_patch.converters.stages.closed_form import LayerChoice
from hf_attn_patch.kv_memory import kv_cache_bytes

from ._fast import FAST


def test_choices_keep_copy_layers_exact_while_the_others_keep_a_rank():
    exact = {l: LayerChoice(24, 16, exact=True) for l in range(4)}  # 40 values each
    choices = retrieval.retrieval_choices([2, 0], exact, 4, 100, rope_dim=4)
    assert [c.exact for c in choices] == [True, False, True, False]
    assert [(c.rope_dim, c.rank) for c in choices if not c.exact] == [(4, 6), (4, 6)]  # (100 - 80) // 2 - 4
    assert sum(c.rope_dim + c.rank for c in choices) <= 100
    # a tight budget keeps none exact (each would leave the others (50 - 40) // 3 - 4 < 1 rank)
    tight = retrieval.retrieval_choices([2, 0], exact, 4, 50, rope_dim=4)
    assert not any(c.exact for c in tight) and {(c.rope_dim, c.rank) for c in tight} == {(4, 8)}
    with pytest.raises(ValueError, match="kv_budget"):
        retrieval.retrieval_choices([], exact, 4, 16, rope_dim=4)


def test_copy_scores_are_the_attention_on_the_earlier_copy(stories):
    model, tokenizer = stories
    segments = calibration_windows(read_calibration_text(None), tokenizer, 2, 24)
    before = model.config._attn_implementation
    scores = retrieval.copy_scores(model, segments)
    assert model.config._attn_implementation == before
    assert scores.shape == (model.config.num_hidden_layers, model.config.num_attention_heads)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attn = model(torch.cat([segments, segments], 1), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(before)
    # layer 3, head 1: queries 24..46 of the second copy, each on the token after its earlier copy (query - 23)
    manual = torch.stack([attn[3][:, 1, q, q - 23] for q in range(24, 47)]).mean()
    assert scores[3, 1] == pytest.approx(float(manual), rel=1e-5)
    assert 0 <= scores.min() and scores.max() <= 1


def test_retrieval_conversion_keeps_copy_layers_exact_within_budget(tmp_path, stories, monkeypatch):
    model, tokenizer = stories
    monkeypatch.setattr(retrieval, "COPY_THRESHOLD", -1.0)  # every layer a candidate, best copy score first
    report = convert("default", tmp_path / "out", to="mla", kv_budget=0.75, rank_allocation="retrieval", **FAST)
    b = report["budgets"]
    assert b["allocation"] == "retrieval" and b["values_per_token"] <= b["budget_values_per_token"] == 240
    kept = b["exact_layers"]
    assert 0 < len(kept) < 5
    scores = {c["layer"]: c["copy_score"] for c in b["layers"]}
    assert min(scores[l] for l in kept) >= max(s for l, s in scores.items() if l not in kept)  # the best copiers
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert saved.config.mla_kv_lora_ranks == [c["kv_lora_rank"] for c in b["layers"]]
    assert saved.config.mla_qk_rope_head_dims == [c["rope_dim"] for c in b["layers"]]
    assert kv_cache_bytes(saved.config, 1) == 2 * b["values_per_token"] <= kv_cache_bytes(model.config, 1) * 3 // 4
    # an exact layer's attention is the source's: the same output on the same inputs
    ids = calibration_windows(read_calibration_text(None), tokenizer, 1, 64)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        for l in kept:
            layer, ref = saved.model.layers[l], model.model.layers[l]
            pos = saved.model.rotary_emb(hidden[l], torch.arange(64)[None])
            x = layer.input_layernorm(hidden[l])
            out = layer.self_attn(x, position_embeddings=pos, attention_mask=None)[0]
            want = ref.self_attn(x, position_embeddings=pos, attention_mask=None)[0]
            # fp32, 64-wide reductions and a 64-long softmax: eps 1.2e-7 x 128 x safety 100 on outputs of order 1
            assert (out - want).abs().max() < 1.2e-7 * 128 * 100
    assert "(copy heads) kept exact" in (tmp_path / "out" / "README.md").read_text()


def test_retrieval_allocation_needs_a_native_mla_budget():
    with pytest.raises(ValueError, match="rank_allocation='retrieval' needs"):
        ConvertOptions.from_flat(to="mla", kv_budget=0.5, rank_allocation="retrieval", format="deepseek_v3")
    with pytest.raises(ValueError, match="rank_allocation='retrieval' needs"):
        ConvertOptions.from_flat(to="mla", kv_lora_rank=8, rank_allocation="retrieval")
