"""Bad attention-variant configs fail when the config is built, naming the field and the value."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

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
