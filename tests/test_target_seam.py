"""A new conversion target enters through one door: its own module (here, this file) and one `register_target(...)`.

The target here lives in this file only (nothing in the package names it): GQA with half the source's KV heads,
each pair averaged (the baseline merge), written in the native format only, with a `--context long` default and a
model card section of its own. Registered for the test's duration, it is offered by the options and the CLI,
converts a real model end to end (the result matches the package's own GQA 'mean' merge), writes its card lines, and
is refused for a format it does not declare, with a message naming the targets that have it."""

from __future__ import annotations

import json

import pytest
import torch

from hf_attn_patch.cli import build_parser
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.methods.gqa_merge import mean_pool
from hf_attn_patch.converters.options import ConvertOptions, register_target, target_names
from hf_attn_patch.converters.options.registry import unregister_target
from hf_attn_patch.converters.targets import ConversionTarget, LayerResult, Target
from hf_attn_patch.converters.targets.base import LayerConfigs, converted_config, resolve_steps
from hf_attn_patch.models import load_source

from ._fast import FAST


class HalfKVTarget(ConversionTarget):
    """GQA with half the source's KV heads, consecutive pairs averaged: no calibration statistics, one plan for
    every layer, the native format."""

    name = "half_kv"
    variant = "gqa"
    methods = ("mean",)
    long_context = {"heal_lr": 1e-5}  # what `--context long` fills in for this target

    def resolve(self, source, opts, stock_format: bool) -> Target:
        if source.shape.kv_heads % 2:
            raise ValueError(f"to='half_kv' needs an even number of KV heads, not {source.shape.kv_heads}")
        opts = resolve_steps(opts, 0.5)
        return Target(
            opts,
            source.shape.kv_heads,
            source.shape.head_dim,
            stock_format,
            kv_share=0.5,
            needs_stats=False,
            layerwise=bool(opts.reconstruction.steps),
        )

    def closed_form(self, opts, w, shape, stats, choice) -> LayerResult:
        return LayerResult(mean_pool(w, shape, w.k_w.shape[0] // shape.head_dim // 2))

    def layer_configs(self, config, opts, target, choices, half: int) -> LayerConfigs:
        return LayerConfigs(converted_config(config, self.variant, {"num_key_value_heads": target.source_kv // 2}))

    def report(self, opts, target, plan, layers) -> dict:
        return {"half_kv": {"before": target.source_kv, "after": target.source_kv // 2}}

    def card(self, report: dict) -> dict:
        kv = report["half_kv"]
        return {
            "shape": f" KV heads averaged in pairs: {kv['before']} -> {kv['after']}.",
            "sections": ["Each pair of the source's KV heads became one, their mean.", ""],
        }


@pytest.fixture
def half_kv():
    target = register_target(HalfKVTarget())
    yield target
    unregister_target(target.name)


def test_the_registry_and_the_cli_offer_it(half_kv):
    assert target_names()[-1] == "half_kv"
    args = build_parser().parse_args(["convert", "default", "OUT", "--to", "half_kv"])
    assert args.to == "half_kv"
    assert ConvertOptions.from_flat(to="half_kv").method == "mean"  # its own methods, the default first
    assert ConvertOptions.from_flat(to="half_kv", context="long").healing.lr == 1e-5  # its --context long default
    assert ConvertOptions.from_flat(to="half_kv", context="long", heal_lr=3e-5).healing.lr == 3e-5  # the user's wins


def test_it_converts_and_writes_its_card(half_kv, tmp_path):
    report = convert("default", tmp_path / "half", to="half_kv", **FAST)
    reference = convert("default", tmp_path / "mean", to="gqa", kv_heads=2, method="mean", format="native", **FAST)
    assert report["half_kv"] == {"before": 4, "after": 2} and report["format"] == "native"
    assert report["kv_bytes_per_token_fp16"] == reference["kv_bytes_per_token_fp16"]
    config = json.loads((tmp_path / "half" / "config.json").read_text())
    assert config["attention_variant"] == "gqa" and config["num_key_value_heads"] == 2
    model, tokenizer = load_source(str(tmp_path / "half"))
    same = load_source(str(tmp_path / "mean"))[0]
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, same(ids).logits, atol=0, rtol=0)  # the same weights
    card = (tmp_path / "half" / "README.md").read_text()
    assert "to HALF_KV attention (method `mean`, format `native`). KV heads averaged in pairs: 4 -> 2." in card
    assert "Each pair of the source's KV heads became one, their mean." in card
    assert "hf-attn convert default OUT --to half_kv" in card


def test_a_format_it_does_not_declare_is_refused(half_kv, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"format='stock' exists for to='gqa' / 'mqa' only, not to='half_kv' "
        r"\(its formats: auto, native\)",
    ):
        convert("default", tmp_path / "out", to="half_kv", format="stock", **FAST)
    with pytest.raises(ValueError, match="format='deepseek_v3' exists for to='mla' only, not to='half_kv'"):
        ConvertOptions.from_flat(to="half_kv", format="deepseek_v3")
    with pytest.raises(ValueError, match="kv_heads=2 applies to to='gqa' / 'mqa' only, not to='half_kv'"):
        ConvertOptions.from_flat(to="half_kv", kv_heads=2)  # another target's option
    assert not (tmp_path / "out").exists()


def test_it_is_gone_once_unregistered():
    target = register_target(HalfKVTarget())
    unregister_target(target.name)
    assert "half_kv" not in target_names()
    with pytest.raises(ValueError, match="to='half_kv' is not one of"):
        ConvertOptions.from_flat(to="half_kv")
