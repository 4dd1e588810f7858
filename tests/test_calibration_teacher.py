"""Calibration on samples of the source model itself (calib_source="teacher"), measured on stories260k."""

from __future__ import annotations

import pytest
import torch

from hf_attn_patch.converters.io.calibration import (
    TEACHER_PROMPT,
    calibration_windows,
    read_calibration_text,
    sample_from_teacher,
    teacher_windows,
)
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.stages.target import AUTO_RECONSTRUCT_STEPS, auto_reconstruct_steps
from hf_attn_patch.converters.options import ConvertOptions


@pytest.fixture(scope="module")
def text_windows(stories):
    return calibration_windows(read_calibration_text(None), stories[1], 4, 48)


def test_teacher_windows_are_seeded_prompted_and_not_the_corpus(stories, text_windows, one_torch_thread):
    model = stories[0]
    a = teacher_windows(model, text_windows, seed=3, progress=False)
    b = teacher_windows(model, text_windows, seed=3, progress=False)
    c = teacher_windows(model, text_windows, seed=4, progress=False)
    assert a.shape == text_windows.shape and torch.equal(a[:, :TEACHER_PROMPT], text_windows[:, :TEACHER_PROMPT])
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a[:, TEACHER_PROMPT:] != text_windows[:, TEACHER_PROMPT:]).float().mean() > 0.5  # its own text


def test_a_tiny_nucleus_is_greedy(stories, text_windows, one_torch_thread):
    model = stories[0]
    prompts = text_windows[:, :TEACHER_PROMPT]
    out = sample_from_teacher(model, prompts, 24, seed=0, top_p=1e-6, progress=False)
    assert torch.equal(out, sample_from_teacher(model, prompts, 24, seed=9, top_p=1e-6, progress=False))
    with torch.no_grad():
        logits = model(out).logits[:, TEACHER_PROMPT - 1 : -1]
    logits[..., model.config.eos_token_id] = -float("inf")  # EOS is never sampled
    assert torch.equal(out[:, TEACHER_PROMPT:], logits.argmax(-1))
    with pytest.raises(ValueError, match="top_p=0"):
        sample_from_teacher(model, prompts, 24, top_p=0)


def test_convert_calibrates_on_teacher_samples(tmp_path, one_torch_thread):
    common = dict(to="mla", kv_budget=0.25, calib_samples=4, calib_len=64, reconstruct_steps=10)
    text = convert("default", tmp_path / "text", calib_source="text", **common)
    teacher = convert("default", tmp_path / "teacher", calib_source="teacher", **common)
    assert text["calibration"]["source"] == "text" and teacher["calibration"]["source"] == "teacher"
    # other windows, so other statistics and other layer errors
    assert teacher["layerwise"]["mean_closed_form_error"] != text["layerwise"]["mean_closed_form_error"]
    with pytest.raises(ValueError, match="calib_source='model'"):
        ConvertOptions.from_flat(to="mqa", calib_source="model")


def test_the_cli_calibrates_on_teacher_samples_and_reconstructs_by_default(tmp_path, one_torch_thread):
    import json

    from hf_attn_patch import cli

    cli.main(["convert", "default", str(tmp_path / "o"), "--to", "mqa", "--calib-samples", "2", "--calib-len", "32"])
    report = json.loads((tmp_path / "o" / "conversion_report.json").read_text())
    assert report["calibration"]["source"] == "teacher"
    # reconstruct steps "auto": MQA 4 -> 1 keeps a quarter of the KV values, below half: the longer fit
    assert report["options"]["reconstruct_steps"] == AUTO_RECONSTRUCT_STEPS[1] == 150
    assert report["layerwise"]["reconstruct_steps"] == 150 and len(report["layerwise"]["layers"]) == 5
    cli.main(
        [
            "convert",
            "default",
            str(tmp_path / "m"),
            "--to",
            "mla",
            "--kv-budget",
            "0.5",
            "--calib-samples",
            "2",
            "--calib-len",
            "32",
            "--rank-allocation",
            "uniform",
        ]
    )
    report = json.loads((tmp_path / "m" / "conversion_report.json").read_text())
    assert report["layerwise"]["reconstruct_steps"] == AUTO_RECONSTRUCT_STEPS[0] == 60  # half the KV values: 60


@pytest.mark.parametrize("share, steps", [(1.0, 60), (0.5, 60), (0.499, 150), (1 / 3, 150), (0.25, 150)])
def test_auto_reconstruct_steps_by_kv_share(share, steps):
    assert auto_reconstruct_steps(share) == steps


def test_reconstruct_steps_accepts_auto_only_as_a_word():
    assert ConvertOptions.from_flat(to="mqa", reconstruct_steps="auto").reconstruction.steps == "auto"
    with pytest.raises(ValueError, match="reconstruct_steps='many' must be a non-negative integer"):
        ConvertOptions.from_flat(to="mqa", reconstruct_steps="many")
