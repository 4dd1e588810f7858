"""Closed-form conversions of stories15M give bit-identical weights and configs to the stored record
(scripts/check_conversion_identity.py, which also covers SmolLM2-135M and more cases: run it by hand after a change to
the converter or the attention variants)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_conversion_identity.py"
STORIES15M = ROOT.parent / "shared" / "models" / "stories15m"
CASES = ("stories15m/gqa", "stories15m/mla", "stories15m/latent_kv")


def _script():
    spec = importlib.util.spec_from_file_location("check_conversion_identity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not STORIES15M.is_dir(), reason="needs ../shared/models/stories15m")
@pytest.mark.parametrize("case", CASES)
def test_conversion_is_bit_identical(case, one_torch_thread):
    # one thread, as the record was made: float sums split over threads round differently
    script = _script()
    record = json.loads(script.RECORD.read_text())
    if record["torch"] != torch.__version__:
        pytest.skip(f"the record was made with torch {record['torch']}, this is {torch.__version__}")
    model, options = script.CASES[case]
    got = script.run_case(str(STORIES15M), options)
    assert script.diff(record["cases"][case], got) == []
