"""KV budgets by measured sensitivity (converters/methods/budgets.py, convert(rank_allocation="sensitivity"))."""

import copy
import itertools
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch  # noqa: F401
from hf_attn_patch import PagedKVCache
from hf_attn_patch.converters.methods.budgets import (
    Candidate,
    LayerCandidates,
    budget_values,
    choose,
    exact_plan,
    mla_module,
)
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.models.pretrained import load_source
from hf_attn_patch.converters.methods.exact import stock_attention_layers
from hf_attn_patch.converters.io.layer_source import LayerSource
from hf_attn_patch.converters.methods.mla_plan import lift_plan
from hf_attn_patch.converters.stages import windows as windows_stage
from hf_attn_patch.converters.stages.sensitivity import Measurement
from hf_attn_patch.kv_memory import kv_cache_bytes
from hf_attn_patch.models.architectures import AttentionShape, architecture_of

from ._fast import FAST
from ._inmemory_reference import collect_stats


@pytest.fixture(scope="module")
def source():
    return load_source("default")


def brute_force(options, budget):
    best = None
    for pick in itertools.product(*(range(len(o)) for o in options)):
        size = sum(options[l][k][0] for l, k in enumerate(pick))
        cost = sum(options[l][k][1] for l, k in enumerate(pick))
        if size <= budget and (best is None or cost < best - 1e-12):
            best = cost
    return best


def test_choose_is_optimal_against_brute_force():
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        layers, per_layer = 2 + trial % 3, 2 + trial % 4
        options = [
            [
                (int(torch.randint(1, 12, (), generator=gen)), float(torch.rand((), generator=gen)))
                for _ in range(per_layer)
            ]
            for _ in range(layers)
        ]
        smallest = sum(min(s for s, _ in o) for o in options)
        for budget in range(smallest, sum(max(s for s, _ in o) for o in options) + 2):
            chosen = choose(options, budget)
            assert sum(options[l][k][0] for l, k in enumerate(chosen)) <= budget
            cost = sum(options[l][k][1] for l, k in enumerate(chosen))
            assert cost == pytest.approx(brute_force(options, budget), abs=1e-12)


def test_choose_takes_the_cheap_layer_down_first():
    # layer 0 barely cares about its size, layer 1 does: with room for one large option it goes to layer 1
    options = [[(2, 0.10), (4, 0.09)], [(2, 1.0), (4, 0.0)]]
    assert choose(options, 6) == [0, 1]
    assert choose(options, 8) == [1, 1]
    assert choose(options, 4) == [0, 0]
    with pytest.raises(ValueError, match="budget=3"):
        choose(options, 3)


def test_budget_values_is_floor_of_the_fraction(source):
    model, _ = source
    assert (
        budget_values(AttentionShape.of(model.config), 0.5) == 5 * 64 // 2
    )  # 5 layers x 2 x 4 KV heads x d_h 8, halved
    assert budget_values(AttentionShape.of(model.config), 0.3) == int(0.3 * 320)  # 96: never rounded up past the budget


def test_exact_candidate_reproduces_the_layer(source):
    model, _ = source
    layers = stock_attention_layers(model)
    name, attn = next(iter(layers.items()))
    w = architecture_of(model.config).split_heads(attn)
    shape = AttentionShape.of(model.config)
    plan = exact_plan(w, shape)
    state, fields = lift_plan(plan, w, shape, len(plan.energy))
    # the exact form caches as many values as the source layer: H_kv x d_rot RoPE dims + the V latent
    assert fields["qk_rope_head_dim"] + fields["kv_lora_rank"] == 2 * 4 * 8
    mla = mla_module(state, fields, model.config, 0, fields["mla_rope_pairs"])
    x = torch.randn(2, 17, 64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(17)[None]
    emb = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        ref = attn(x, position_embeddings=emb, attention_mask=None)[0]
        out = mla(x, position_embeddings=emb, attention_mask=None)[0]
    # fp32: eps 1.2e-7 x (64-wide projections + 17-long softmax sums) x |out| ~1 x safety 50
    assert (out - ref).abs().max() < 1.2e-7 * (64 + 17) * 50 * max(1.0, float(ref.abs().max()))


def test_measure_matches_a_full_forward_with_one_layer_replaced(source):
    """The layer-streamed measurement (stages/sensitivity.py) against whole-model forwards with one layer replaced."""
    model, tokenizer = source
    windows = calibration_windows(read_calibration_text(None), tokenizer, 2, 64)
    stats = collect_stats(model, windows)
    layers = stock_attention_layers(model)
    arch = architecture_of(model.config)
    weights = [arch.split_heads(m) for m in layers.values()]
    src = LayerSource.open("default")
    measurement = Measurement(src, windows)
    grid = [Candidate(4, 12), Candidate(8, 24)]
    candidates = [
        LayerCandidates(l, w, model.config, AttentionShape.of(model.config), stats[n], "calibrated", 64, grid)
        for l, (n, w) in enumerate(zip(layers, weights))
    ]
    kl = [measurement.layer(l, src.layer(l), c) for l, c in enumerate(candidates)]
    assert [len(c.options) for c in candidates] == [3] * 5
    assert all(k[-1] == 0.0 for k in kl)  # the exact candidate, not run (its exactness: the tests above and below)
    assert all(c.options[2].exact and not c.options[1].exact for c in candidates)
    with torch.no_grad():
        ref = torch.log_softmax(model(windows).logits, -1)
        for l, k in [(0, 0), (2, 1), (4, 0)]:  # the first, a middle and the last layer
            other = copy.deepcopy(model)
            other.model.layers[l].self_attn = candidates[l].module(k)
            logq = torch.log_softmax(other(windows).logits, -1)
            full = float((ref.exp() * (ref - logq)).sum(-1).mean())
            # the same ops in the same batches, one layer resident at a time: equal up to fp32 rounding of the
            # log-softmax sums (measured equal)
            assert full > 1e-4 and kl[l][k] == pytest.approx(full, rel=1e-5)


def test_sensitivity_conversion_within_budget_and_reported(tmp_path, source):
    model, _ = source
    report = convert("default", tmp_path / "out", to="mla", kv_budget=0.5, rank_allocation="sensitivity", **FAST)
    b = report["budgets"]
    assert b["budget_values_per_token"] == 160
    assert b["values_per_token"] <= 160
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    # the report's bytes are what the saved model caches
    assert kv_cache_bytes(saved.config, 1) == b["bytes_per_token_fp16"] == report["kv_bytes_per_token_fp16"]["after"]
    assert b["bytes_per_token_fp16"] <= b["budget_bytes_per_token_fp16"] == kv_cache_bytes(model.config, 1) // 2
    assert [c["layer"] for c in b["layers"]] == list(range(5))
    assert saved.config.mla_kv_lora_ranks == [c["kv_lora_rank"] for c in b["layers"]]
    assert saved.config.mla_qk_rope_head_dims == [c["rope_dim"] for c in b["layers"]]
    for layer, choice in zip(saved.model.layers, b["layers"]):
        assert layer.self_attn.kv_a_proj_with_mqa.out_features == choice["values_per_token"]
    # the chosen options minimize the summed measured KL within the budget
    options = [[(m["rope_dim"] + m["kv_lora_rank"], m["kl"]) for m in row] for row in b["measured"]]
    assert b["summed_kl"] == pytest.approx(brute_force(options, 160), rel=1e-9)
    # the paged cache sizes each layer by its own RoPE dims + rank, and greedy decoding matches DynamicCache
    cache = PagedKVCache(saved.config, block_size=4)
    assert cache.values_per_token == [c["values_per_token"] for c in b["layers"]]
    ids = torch.tensor([[1, 403, 261, 29, 375, 280]])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(saved.generate(ids, **kw), saved.generate(ids, cache=cache, **kw))
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| layer | choice | RoPE dims | latent rank | KL |" in card and card.count("\n| ") >= 6
    assert json.loads((tmp_path / "out" / "conversion_report.json").read_text())["budgets"]["layers"] == b["layers"]


def test_full_budget_keeps_every_layer_exact(tmp_path, source):
    model, tokenizer = source
    report = convert("default", tmp_path / "out", to="mla", kv_budget=1.0, rank_allocation="sensitivity", **FAST)
    assert {c["choice"] for c in report["budgets"]["layers"]} == {"unconverted (exact MLA)"}
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert kv_cache_bytes(saved.config, 1) == kv_cache_bytes(model.config, 1)
    ids = calibration_windows(read_calibration_text(None), tokenizer, 2, 128)
    with torch.no_grad():
        ref, out = model(ids).logits, saved(ids).logits
    # fp32: eps 1.2e-7 x (64-wide reductions + 172-wide MLP + 128-long softmax) x 5 layers x safety 10 (2.2e-3;
    # measured 2e-5 on logits up to 22)
    assert (out - ref).abs().max() < 1.2e-7 * (64 + 172 + 128) * 5 * 10


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(to="mla", kv_lora_rank=8, rank_allocation="sensitivity"), "rank_allocation='sensitivity' needs"),
        (dict(to="mla", kv_budget=0.5, rank_allocation="sensitivity", format="deepseek_v3"), "one qk_rope_head_dim"),
        (dict(to="gqa", kv_heads=2, rank_allocation="sensitivity"), "rank_allocation='sensitivity' needs"),
        (dict(to="mla", kv_budget=0.5, rank_allocation="budget"), "rank_allocation='budget'"),
        (dict(to="mla", kv_budget=0.02, rank_allocation="sensitivity"), "kv_budget=0.02 gives 6 KV values"),
    ],
)
def test_bad_input_is_refused_before_any_work(tmp_path, monkeypatch, options, match):
    def never(*args, **kwargs):
        raise AssertionError("calibration started before the options were checked")

    monkeypatch.setattr(windows_stage, "calibration_windows", never)
    with pytest.raises(ValueError, match=match):
        convert("default", tmp_path / "out", **options, **FAST)
    assert not (tmp_path / "out").exists()
