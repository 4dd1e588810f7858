"""Bad attention-variant configs fail when the config is built, and bad conversion options when the options are
built, naming the field and the value."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from hf_attn_patch.converters.options import (
    FLAT_NAMES,
    CalibrationOptions,
    ConvertOptions,
    HealingOptions,
    OutputOptions,
    ReconstructionOptions,
)
from hf_attn_patch.models import validate_variant_config

from .conftest import tiny_config

MLA = dict(attention_variant="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize(
    "model_type,fields,message",
    [
        ("llama", dict(attention_variant="mha"), "attention_variant='mha' is not one of"),
        ("gpt2", dict(attention_variant="gqa", num_key_value_heads=4), "num_key_value_heads=4 must divide num_attention_heads=6"),
        ("gpt2", dict(attention_variant="gqa"), "num_key_value_heads=None must be a positive integer"),
        ("opt", dict(attention_variant="gqa", num_key_value_heads=0), "num_key_value_heads=0 must be a positive"),
        ("llama", {**MLA, "kv_lora_rank": 49}, "kv_lora_rank=49 exceeds the rank"),
        ("llama", {**MLA, "q_lora_rank": 100}, "q_lora_rank=100 exceeds the rank"),
        ("llama", {k: v for k, v in MLA.items() if k != "v_head_dim"}, "needs the config field v_head_dim, which is missing"),
        ("llama", {**MLA, "qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even"),
        ("llama", {**MLA, "qk_rope_head_dim": 16}, "qk_rope_head_dim=16 exceeds the 8 rotary dims"),
        ("llama", {**MLA, "mla_rope_pairs": [0, 1, 2, 9]}, r"mla_rope_pairs=\[9\] out of range"),
        ("llama", {**MLA, "mla_rope_pairs": [0]}, "mla_rope_pairs has 1 entries, qk_rope_head_dim=8 needs 4"),
        ("gpt2", {**MLA, "kv_lora_rank": 8}, "qk_rope_head_dim=8 but this architecture has no rotary embedding"),
        ("llama", {**MLA, "kv_lora_rank": -3}, "kv_lora_rank=-3 must be a positive integer"),
        ("deepseek_v3", dict(attention_variant="gqa"), "attention_variant='gqa' is not available for model_type='deepseek_v3'"),
    ],
)  # fmt: skip
def test_bad_config_is_rejected_when_built(model_type, fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(model_type, **fields)


def test_unsupported_architecture_is_named():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="model_type='phi' is not supported"):
        AutoConfig.for_model("phi", attention_variant="gqa", num_key_value_heads=1)


def test_bad_config_json_fails_before_any_weight_loads(tmp_path):
    """A folder with a bad config.json and *no weights at all*: the config error comes first."""
    config = tiny_config("llama").to_dict()
    config.update(attention_variant="mla", kv_lora_rank=8, qk_nope_head_dim=8, v_head_dim=8)  # no qk_rope_head_dim
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="needs the config field qk_rope_head_dim"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_good_configs_pass():
    validate_variant_config(tiny_config("llama", **MLA))
    validate_variant_config(tiny_config("gpt_neox", attention_variant="gqa", num_key_value_heads=1))


# --- conversion options (converters/options/): each section names the flat option and its value ---


@pytest.mark.parametrize(
    "section, fields, message",
    [
        (CalibrationOptions, dict(source="model"), "calib_source='model' is not one of"),
        (CalibrationOptions, dict(samples=0), "calib_samples=0 must be a positive integer"),
        (CalibrationOptions, dict(length=True), "calib_len=True must be a positive integer"),
        (ReconstructionOptions, dict(steps=-1), "reconstruct_steps=-1 must be a non-negative integer"),
        (ReconstructionOptions, dict(steps="many"), "reconstruct_steps='many' must be a non-negative integer"),
        (ReconstructionOptions, dict(lr=0), "reconstruct_lr=0 must be a positive number"),
        (ReconstructionOptions, dict(target="global"), "reconstruct_target='global' is not one of"),
        (ReconstructionOptions, dict(attention_kl=-1.0), "reconstruct_attention_kl=-1.0 must be a non-negative"),
        (ReconstructionOptions, dict(attention_kl="yes"), "reconstruct_attention_kl='yes' must be a non-negative"),
        (HealingOptions, dict(steps=-2), "heal_steps=-2 must be a non-negative integer"),
        (HealingOptions, dict(lr=1e-3), r"heal_lr=0.001 applies to healing only: set heal_steps"),
        (HealingOptions, dict(held_in=2), "heal_held_in=2 applies to healing only"),
        (HealingOptions, dict(steps=1, lr="fast"), "heal_lr='fast' must be a positive number or 'auto'"),
        (HealingOptions, dict(steps=1, data="web"), "heal_data='web' is not one of"),
        (HealingOptions, dict(steps=1, batch_size=0), "heal_batch_size=0 must be a positive integer"),
        (HealingOptions, dict(steps=1, layerwise_steps=-1), "heal_layerwise_steps=-1 must be a non-negative"),
        (HealingOptions, dict(steps=1, checkpoint_every=2), "resume / checkpoint_every need checkpoint_dir"),
        (HealingOptions, dict(steps=1, checkpoint_dir="c", checkpoint_every=-1), "checkpoint_every=-1 must be"),
        (OutputOptions, dict(max_shard_size="lots"), "max_shard_size='lots': expected a positive size"),
        (OutputOptions, dict(push_to_hub="no-owner"), "push_to_hub='no-owner' must look like 'owner/name'"),
    ],
)  # fmt: skip
def test_each_options_section_names_the_field_and_value(section, fields, message):
    with pytest.raises(ValueError, match=message):
        section(**fields)


@pytest.mark.parametrize(
    "flat, message",
    [
        (dict(to="mla", kv_budget=0.5, calib_samples=1, reconstruct_steps=3), "calib_samples=1: propagate"),
        (dict(to="mqa", heal_steps=2, calib_samples=1, reconstruct_steps=0), "calib_samples=1: propagate"),
        (dict(to="gqa", kv_heads=2, rank_allocation="sensitivity"), "rank_allocation='sensitivity' needs"),
        (dict(to="mqa", kv_budget=0.5), "kv_budget=0.5 applies to to='mla' / 'latent_kv' only"),
        (dict(to="mla", kv_budget=0.5, regroup=True), "regroup=True applies to"),
        (dict(to="mla", kv_budget=0.5, engine="vllm"), "engine='vllm' applies to format='deepseek_v3' only"),
        (dict(to="gqa", kv_heads=2, rope_context=4096), "rope_context=4096 applies to to='mla' / 'latent_kv' only"),
        (dict(to="mla", kv_budget=0.5, rope_context=0), "rope_context=0 must be a positive integer"),
    ],
)  # fmt: skip
def test_checks_across_sections(flat, message):
    with pytest.raises(ValueError, match=message):
        ConvertOptions.from_flat(**flat)


@pytest.mark.parametrize("flat", [
    dict(to="mla", kv_budget=0.5),
    dict(to="mqa", method="mean"),
    dict(to="gqa", kv_heads=2, heal_steps=3, heal_lr=1e-4, calib_len=64, checkpoint_dir="ckpt", checkpoint_every=1),
    dict(to="mla", kv_lora_rank=8, format="deepseek_v3", calib_source="text", reconstruct_steps=0, max_shard_size="1GB"),
])  # fmt: skip
def test_from_flat_round_trips_with_flat(flat):
    opts = ConvertOptions.from_flat(**flat)
    assert list(opts.flat()) == list(FLAT_NAMES)  # the report's "options" keys
    assert {k: v for k, v in opts.flat().items() if k in flat} == flat
    assert ConvertOptions.from_flat(**opts.flat()) == opts
    assert opts.calibration.length == flat.get("calib_len", 256) and opts.healing.steps == flat.get("heal_steps", 0)


def test_defaults_fill_only_the_options_that_apply():
    plain = ConvertOptions.from_flat(to="mqa")
    assert plain.healing == HealingOptions() and plain.healing.lr is None and plain.regroup is True
    healed = ConvertOptions.from_flat(to="mqa", heal_steps=1).healing
    assert (healed.lr, healed.batch_size, healed.held_in, healed.train, healed.data, healed.layerwise_steps) == (
        "auto",
        4,
        4,
        "attention",
        "teacher",
        40,
    )
    assert ConvertOptions.from_flat(to="mla", kv_budget=0.5).regroup is None  # MLA has no KV head groups


def test_unknown_flat_name_is_refused():
    with pytest.raises(TypeError, match="unknown conversion option 'calib_samplez'"):
        ConvertOptions.from_flat(to="mqa", calib_samplez=8)
    with pytest.raises(TypeError, match="'to' is required"):
        ConvertOptions.from_flat(kv_heads=2)
    with pytest.raises(TypeError, match="calibration=.* is not a CalibrationOptions"):
        ConvertOptions(to="mqa", calibration={"samples": 8})
