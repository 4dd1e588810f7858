"""Closed-form conversions of stories15M give bit-identical weights and configs to the stored record
(scripts/check_conversion_identity.py, which also covers SmolLM2-135M and more cases: run it by hand after a change to
the converter or the attention variants, or `--against main` on any machine). The conversions run in the script's
child process with the numerics pinned (its NUMERICS), whatever this process's thread settings are; float results
still differ between processor families, so the record holds hashes per CPU and a CPU without one skips."""

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


def _script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as `python scripts/x.py` runs it: benchlib is found
    spec = importlib.util.spec_from_file_location("check_conversion_identity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not STORIES15M.is_dir(), reason="needs ../shared/models/stories15m")
@pytest.mark.parametrize("case", CASES)
def test_conversion_is_bit_identical(case, monkeypatch):
    script = _script(monkeypatch)
    record = json.loads(script.RECORD.read_text())
    if record["torch"] != torch.__version__:
        pytest.skip(f"the record was made with torch {record['torch']}, this is {torch.__version__}")
    assert record["numerics"] == script.NUMERICS  # the record was made with the settings the child runs with
    want = script.recorded(record, script.cpu_key())
    if not want:
        pytest.skip(f"no record for this CPU ({script.cpu_key()}); recorded: {sorted(record['cpus'])}")
    got = script.run_pinned([case], STORIES15M.parent)
    assert got["torch"] == record["torch"]
    assert script.diff(want[case], got["cases"][case]) == []
