"""The layer-streamed convert() against the in-memory conversion it replaced (tests/_inmemory_reference.py): every
saved tensor torch.equal and the same config.json, on stories260k and stories15M, for GQA, MQA, MLA (uniform,
energy and sensitivity ranks) and the deepseek_v3 export, with propagated calibration and reconstruction steps.
Streamed, each layer runs on the same batches of windows as the whole model did, so nothing may differ at all.
SmolLM2-135M (one case): within fp32 noise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_attn_patch.converters.convert import convert

from ._inmemory_reference import convert_in_memory

STORIES15M = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories15m"
SMALL = {"calib_samples": 6, "calib_len": 32}  # 6 windows: 2 held in by the layer-wise fits

CASES = {
    "gqa-propagate": dict(to="gqa", kv_heads=2, calib_source="text", reconstruct_steps=3, propagate=True),
    "mqa-teacher-local": dict(to="mqa", reconstruct_steps=2, reconstruct_target="local"),
    "mla-uniform": dict(to="mla", kv_budget=0.5, rank_allocation="uniform", calib_source="text", reconstruct_steps=3,
                        propagate=True),
    "mla-sensitivity": dict(to="mla", kv_budget=0.5, reconstruct_steps=3, propagate=True),
    "mla-energy-block": dict(to="mla", kv_budget=0.4, rank_allocation="energy", calib_source="text",
                             reconstruct_steps=2, reconstruct_target="block"),
    "deepseek_v3": dict(to="mla", kv_budget=0.5, format="deepseek_v3", calib_source="text", reconstruct_steps=3,
                        propagate=True),
}  # fmt: skip


def saved(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """({name: tensor} over every shard, config.json without the writing library's version)."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    config = json.loads((folder / "config.json").read_text())
    config.pop("transformers_version", None)
    return tensors, config


def both(source: str, tmp_path: Path, options: dict):
    report = convert(source, tmp_path / "streamed", **options)
    model, reference_report = convert_in_memory(source, **options)
    model.save_pretrained(tmp_path / "in-memory")
    return saved(tmp_path / "streamed"), saved(tmp_path / "in-memory"), report, reference_report


def assert_identical(streamed, in_memory) -> None:
    (got, got_config), (want, want_config) = streamed, in_memory
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, different[:5]
    assert got_config == want_config


@pytest.mark.parametrize("case", list(CASES))
def test_stories260k_streamed_equals_in_memory(tmp_path, case, one_torch_thread):
    streamed, in_memory, report, reference = both("default", tmp_path, {**CASES[case], **SMALL})
    assert_identical(streamed, in_memory)
    for key in reference:  # the report keeps every key; layer-wise errors and budgets are the same numbers
        assert key in report, key
    for key in ("layerwise", "budgets", "mla", "deepseek_v3"):
        if key in reference:
            strip = lambda d: {k: v for k, v in d.items() if "seconds" not in k}  # noqa: E731
            if key == "layerwise":
                assert [strip(a) for a in report[key]["layers"]] == [strip(b) for b in reference[key]["layers"]]
            elif key == "budgets":
                assert report[key]["measured"] == reference[key]["measured"]
                assert report[key]["layers"] == reference[key]["layers"]
            else:
                assert report[key] == reference[key], key
    assert report["activations"]["placement"] == "cpu" and report["activations"]["bytes"] > 0
    assert set(report["stages"]) >= {"target", "calibration", "plan", "layers"}


@pytest.mark.skipif(not STORIES15M.exists(), reason="../shared/models/stories15m not present")
@pytest.mark.parametrize(
    "case", ["gqa-propagate", "mqa-teacher-local", "mla-uniform", "mla-sensitivity", "deepseek_v3"]
)
def test_stories15m_streamed_equals_in_memory(tmp_path, case, one_torch_thread):
    options = {**CASES[case], "calib_samples": 4, "calib_len": 32}
    if options["to"] == "gqa":
        options["kv_heads"] = 2  # 6 KV heads
    streamed, in_memory, *_ = both(str(STORIES15M), tmp_path, options)
    assert_identical(streamed, in_memory)


@pytest.mark.smollm2
def test_smollm2_streamed_within_fp32_noise(tmp_path, one_torch_thread):
    """One SmolLM2-135M case (kept short): MLA 50% with uniform ranks, text calibration, propagated statistics and one
    reconstruction step per layer."""
    options = dict(
        to="mla",
        kv_budget=0.5,
        rank_allocation="uniform",
        calib_source="text",
        calib_samples=2,
        calib_len=64,
        reconstruct_steps=1,
        propagate=True,
    )
    (got, got_config), (want, want_config), *_ = both("smollm2", tmp_path, options)
    assert got.keys() == want.keys() and got_config == want_config
    for name in want:  # fp32: the same ops; a differing reduction order would stay within a few ulps of the values
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6 * float(want[name].abs().max()))
