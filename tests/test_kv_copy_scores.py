"""Copy scores per KV head (converters/stages/retrieval.py: kv_copy_scores, copy_kv_heads): the max over the query
heads that share a KV head, grouped as the model groups them."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import repeat_kv

from hf_attn_patch.converters.stages import retrieval

from .conftest import tiny_model


def test_kv_copy_scores_group_query_heads_as_the_model_does():
    model = tiny_model("llama", attn_implementation="eager")  # 6 query heads, 2 KV heads: 3 per KV head
    segments = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    scores = retrieval.copy_scores(model, segments)
    kv = retrieval.kv_copy_scores(scores, model.config.num_key_value_heads)
    assert scores.shape == (2, 6) and kv.shape == (2, 2)
    assert torch.equal(kv, torch.stack([scores[:, :3].amax(1), scores[:, 3:].amax(1)], dim=1))
    # transformers' grouping: query head h reads KV head h // 3
    x = torch.arange(2.0)[None, :, None, None]
    assert repeat_kv(x, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]
    # changing KV head 1's keys in layer 0 changes the scores of query heads 3..5 there and of no other
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[8:16] *= 3.0  # head_dim 8: KV head 1's rows
    after = retrieval.copy_scores(model, segments)
    changed = (after[0] - scores[0]).abs() > 1e-6
    assert changed.tolist() == [False, False, False, True, True, True]
    after_kv = retrieval.kv_copy_scores(after, 2)
    assert after_kv[0, 0] == kv[0, 0] and after_kv[0, 1] != kv[0, 1]


def test_copy_kv_heads_are_those_above_the_threshold_best_first():
    kv = torch.tensor([[0.10, 0.50], [0.31, 0.05], [0.50, 0.90]])
    assert retrieval.copy_kv_heads(kv, threshold=0.3) == [(2, 1), (0, 1), (2, 0), (1, 0)]  # ties: lower layer first
    assert retrieval.copy_kv_heads(kv, threshold=0.95) == []
    assert retrieval.copy_kv_heads(kv) == retrieval.copy_kv_heads(kv, retrieval.COPY_THRESHOLD)


def test_kv_copy_scores_refuse_a_bad_grouping():
    with pytest.raises(ValueError, match="kv_heads=4 must be a positive divisor of the 6 query heads"):
        retrieval.kv_copy_scores(torch.zeros(2, 6), 4)
    with pytest.raises(ValueError, match="kv_heads=0"):
        retrieval.kv_copy_scores(torch.zeros(2, 6), 0)
    with pytest.raises(ValueError, match="scores: \\[layers, heads\\]"):
        retrieval.kv_copy_scores(torch.zeros(6), 2)
    with pytest.raises(ValueError, match="kv_scores: \\[layers, kv_heads\\]"):
        retrieval.copy_kv_heads(torch.zeros(6))
