"""The feature drafter (hf-attn draft): exact speculative decoding with it, saving and loading, building."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_attn_patch
from hf_attn_patch.converters.drafting import build_drafter
from hf_attn_patch.converters.drafting.train import new_drafter
from hf_attn_patch.models.pretrained import load_default
from hf_attn_patch.speculative import SpeculativeStats
from hf_attn_patch.speculative.feature_drafter import FeatureDrafterConfig, FeatureDrafterForCausalLM

from .conftest import tiny_model
from .test_speculative import PROMPTS, assert_second_token_marginal


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """stories260k and a drafter trained for it in a few seconds (few steps: some drafts right, many wrong)."""
    out = tmp_path_factory.mktemp("drafter") / "out"
    report = build_drafter("default", out, samples=64, length=64, draft_vocab=256, steps=80, progress=False)
    model, tok = load_default()
    tok.padding_side, tok.pad_token = "left", tok.pad_token or tok.eos_token
    return model, tok, AutoModelForCausalLM.from_pretrained(out), out, report


@pytest.mark.parametrize("cache", [None, "paged_kv"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("draft_length", [3, "adaptive"])
def test_greedy_identical_to_plain_generate(built, cache, rows, draft_length):
    model, tok, drafter, _, _ = built
    enc = tok(PROMPTS[:rows], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=40, do_sample=False, cache_implementation=cache)
    reference = model.generate(**enc, **kw)
    stats = SpeculativeStats()
    out = model.generate(**enc, assistant_model=drafter, draft_length=draft_length, speculative_stats=stats, **kw)
    assert torch.equal(out, reference)
    assert stats.proposed > 0
    if draft_length == 3:  # (the adaptive length may stop drafting after a few rejections of this weak drafter)
        assert 0 < stats.accepted < stats.proposed  # accepted and rejected drafts both happened


def test_saved_with_tokenizer_and_target_and_without_its_embeddings(built):
    model, _, drafter, out, report = built
    assert isinstance(drafter, FeatureDrafterForCausalLM)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "hf_attn_feature_drafter" and config["drafts_for"]["vocab_size"] == 512
    assert (out / "tokenizer.json").exists() or (out / "tokenizer.model").exists()
    # the target's embedding / LM head ([512, 64]) are bound at run time, never stored
    assert all(t.shape[0] != model.config.vocab_size for t in drafter.state_dict().values())
    assert report["held_in_top1_agreement_by_depth"][0] > 0 and report["sampling_s"] >= 0


def test_hook_on_the_target_is_released(built):
    model, tok, drafter, _, _ = built
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    model.generate(**enc, assistant_model=drafter, max_new_tokens=4, do_sample=False)
    assert not model.get_decoder()._forward_hooks
    with pytest.raises(ValueError, match="draft_length"):
        model.generate(**enc, assistant_model=drafter, max_new_tokens=4, draft_length=0)
    assert not model.get_decoder()._forward_hooks


def test_unpatch_restores_the_auto_registries():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    assert "hf_attn_feature_drafter" in CONFIG_MAPPING
    with hf_attn_patch.unpatched():
        assert "hf_attn_feature_drafter" not in CONFIG_MAPPING
        assert FeatureDrafterConfig not in MODEL_FOR_CAUSAL_LM_MAPPING._extra_content
    assert MODEL_FOR_CAUSAL_LM_MAPPING._extra_content[FeatureDrafterConfig] is FeatureDrafterForCausalLM


def test_wrong_target_is_refused(built):
    _, _, drafter, _, _ = built
    with pytest.raises(ValueError, match="hidden_size=64"):
        drafter.bind(tiny_model("llama"))


def test_sampling_matches_target_marginal():
    """As test_speculative's end-to-end check: with a random drafter over half the vocabulary (q = 0 elsewhere), the
    second token's empirical distribution converges to the target's exact marginal."""
    target = tiny_model("llama", seed=0)
    drafter = new_drafter(target, torch.arange(0, target.config.vocab_size, 2))
    assert_second_token_marginal(target, drafter)


@pytest.mark.parametrize(
    "option, value, match",
    [("steps", 0, "steps=0"), ("draft_vocab", 4, "draft_vocab=4"), ("length", 20, "longest prompt")],
)
def test_build_refuses_bad_input_before_writing(tmp_path, option, value, match):
    with pytest.raises(ValueError, match=match):
        build_drafter("default", tmp_path / "out", **{option: value}, progress=False)
    assert not any(tmp_path.iterdir())


def test_build_refuses_an_existing_output(tmp_path):
    with pytest.raises(FileExistsError, match="exists"):
        build_drafter("default", tmp_path, steps=1, progress=False)


@pytest.mark.parametrize("rows", [1, 3])
def test_lookup_with_the_drafter_is_exact(built, rows):
    """n-gram lookup where the history repeats, the drafter elsewhere: greedy identical, sampling exact."""
    model, tok, drafter, _, _ = built
    enc = tok(PROMPTS[:rows], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=40, do_sample=False)
    stats = SpeculativeStats()
    out = model.generate(**enc, assistant_model=drafter, prompt_lookup_num_tokens=4, speculative_stats=stats, **kw)
    assert torch.equal(out, model.generate(**enc, **kw)) and stats.accepted > 0
    sampled = model.generate(
        **enc, assistant_model=drafter, prompt_lookup_num_tokens=4, do_sample=True, max_new_tokens=16
    )
    assert sampled.shape[0] == rows and not model.get_decoder()._forward_hooks


def test_teacher_features_are_what_the_lm_head_reads_at_each_position():
    """Drafter training pairs token t_i with h_i, the post-norm state the LM head reads after t_0..t_i: the
    captured states must give the logits of one full forward over the sample (an off-by-one in stitching the
    decode steps, or a pre-norm capture, breaks it). fp32, cached decode vs one pass: differences ~1e-6."""
    from hf_attn_patch.converters.drafting.samples import teacher_samples
    from hf_attn_patch.converters.io.calibration import read_calibration_text

    model, tok = load_default()
    tokens, hidden = teacher_samples(model, tok, read_calibration_text(None), 6, 56, progress=False)
    assert tokens.shape == (6, 56) and hidden.shape == (6, 55, model.config.hidden_size)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    head = model.get_output_embeddings().weight
    torch.testing.assert_close(hidden @ head.T, logits, atol=1e-4, rtol=1e-4)
