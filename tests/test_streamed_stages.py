"""Stages of the streamed conversion on their own: teacher sampling with the source offloaded by accelerate when the
whole model does not fit the budget; the report's per-stage figures."""

from __future__ import annotations

import torch

from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.converters.stages.source import open_source
from hf_attn_patch.converters.stages.windows import calibrate


def test_teacher_sampling_offloaded_equals_whole(one_torch_thread):
    """Budget 0 bytes: accelerate's big-model inference (device_map 'auto', weights on disk) samples the same
    windows as the whole model (the same ops on the CPU, weights moved in per layer)."""
    source = open_source("default", "cpu")
    opts = ConvertOptions.from_flat(to="mqa", calib_samples=2, calib_len=16)
    whole = calibrate(source, opts, True)
    offloaded = calibrate(source, opts, True, budget=0)
    assert whole.teacher_sampling["mode"] == "whole" and offloaded.teacher_sampling["mode"] == "offload"
    assert offloaded.teacher_sampling["seconds"] > 0
    assert torch.equal(whole.windows, offloaded.windows)
    text = calibrate(source, ConvertOptions.from_flat(to="mqa", calib_source="text"), True)
    assert text.teacher_sampling is None and text.windows.shape == (32, 256)
    assert calibrate(source, opts, False).windows is None
