"""Mixed-length calibration (converters/io/packing.py, convert(calib_lengths=...)): samples of several lengths
packed into each calibration window, positions restarting per sample, attention within it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_attn_patch.converters.convert import convert
from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text
from hf_attn_patch.converters.io.layer_stream import LayerRunner
from hf_attn_patch.converters.io.packing import packed_positions, packed_teacher_windows, parse_lengths
from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.converters.stages.source import open_source

from ._fast import FAST


@torch.no_grad()
def last_layer_output(model, ids: torch.Tensor) -> torch.Tensor:
    """The last decoder layer's output [n, T, D] (the final norm's input) of a whole-model forward."""
    captured = []
    handle = model.model.norm.register_forward_pre_hook(lambda m, a: captured.append(a[0]))
    try:
        model(ids)
    finally:
        handle.remove()
    return captured[0]


def test_packed_windows_run_each_sample_alone(stories, one_torch_thread):
    model, tokenizer = stories
    src = open_source("default", "cpu").layers
    src.load_resident()
    ids = calibration_windows(read_calibration_text(None), tokenizer, 2, 64)
    outputs = {}
    for positions in (None, packed_positions((48, 16))):
        src.positions = positions
        runner = LayerRunner(src, 64, 2)
        hidden = torch.empty(2, 64, model.config.hidden_size)
        runner.embed(ids, hidden)
        for i in range(src.num_layers):
            out = torch.empty_like(hidden)
            runner.apply(src.layer(i), i, hidden, out)
            hidden = out
        outputs[positions is None] = hidden
    packed, plain = outputs[False], outputs[True]
    first, second = last_layer_output(model, ids[:, :48]), last_layer_output(model, ids[:, 48:])
    # fp32, the same operations in another batch shape: 1e-4 on values of order 1 (measured 0)
    assert torch.allclose(packed[:, :48], first, atol=1e-4) and torch.allclose(packed[:, 48:], second, atol=1e-4)
    assert (plain[:, 48:] - second).abs().max() > 0.1  # unpacked, the second sample sees the first: the test can fail


def test_packed_teacher_windows_sample_each_slot_from_its_own_start():
    calls = []

    def sample(teacher, windows, seed=0):
        calls.append((windows.shape, seed))
        return windows + 1000 * windows.shape[1]  # marks each slot with its length

    text = torch.arange(2 * 10).view(2, 10)
    out = packed_teacher_windows(sample, None, text, (4, 2, 4), seed=3)
    assert calls == [(torch.Size([2, 2]), 3), (torch.Size([4, 4]), 3)]  # the 2s, then both 4-slots together
    assert torch.equal(out[:, :4], text[:, :4] + 4000) and torch.equal(out[:, 4:6], text[:, 4:6] + 2000)
    assert torch.equal(out[:, 6:], text[:, 6:] + 4000)
    assert packed_positions((3, 2)).tolist() == [0, 1, 2, 0, 1]


def test_mixed_calibration_equals_the_same_samples_as_separate_windows(tmp_path, stories, one_torch_thread):
    """Text calibration packed as 2 windows of 64,64 holds the same 4 samples as 4 windows of 64: the closed form's
    statistics are the same sums, so the conversions agree (up to fp64 summation order)."""
    model, tokenizer = stories
    kw = dict(to="mla", kv_lora_rank=16, overwrite=True, **FAST)
    packed = convert("default", tmp_path / "packed", calib_samples=2, calib_len=128, calib_lengths="64,64", **kw)
    assert packed["calibration"]["lengths"] == "64,64"
    convert("default", tmp_path / "plain", calib_samples=4, calib_len=64, rope_context=128, **kw)
    convert("default", tmp_path / "unpacked", calib_samples=2, calib_len=128, **kw)
    ids = calibration_windows(read_calibration_text(None), tokenizer, 6, 96)[4:]  # after the calibration text
    with torch.no_grad():
        logits = {
            n: AutoModelForCausalLM.from_pretrained(tmp_path / n)(ids).logits for n in ("packed", "plain", "unpacked")
        }
    # fp32 logits of order 10 from fp64 closed forms: 1e-3 (measured ~1e-5); unpacked windows differ by ~0.1
    assert (logits["packed"] - logits["plain"]).abs().max() < 1e-3
    assert (logits["unpacked"] - logits["plain"]).abs().max() > 1e-2


@pytest.mark.parametrize(
    "lengths, error", [("64,32", "summing to calib_len=128"), ("a,b", "comma-separated"), ("127,1", "lengths >= 2")]
)
def test_calib_lengths_refused(lengths, error):
    with pytest.raises(ValueError, match=error):
        ConvertOptions.from_flat(to="mla", kv_lora_rank=8, calib_len=128, calib_lengths=lengths)
    with pytest.raises(ValueError, match="calib_lengths"):
        ConvertOptions.from_flat(to="mla", kv_lora_rank=8, calib_len=128, calib_lengths="64,64", heal_steps=1)
    assert parse_lengths("64,64", 128) == (64, 64)
