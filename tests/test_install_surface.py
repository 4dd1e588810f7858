"""What a user meets first: one set of conversion defaults for the CLI and Python, optional extras named in one line
before any work, the engine placed on a device and sized by a share of its memory, and /health's pool report."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from hf_attn_patch import extras
from hf_attn_patch.cli import build_parser, convert_options
from hf_attn_patch.converters.options import ConvertOptions
from hf_attn_patch.devices import resolve_device, resolve_dtype
from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.engine.memory import device_memory, kv_budget
from hf_attn_patch.models.pretrained import load_default

from ._server import http, running


@pytest.mark.parametrize("argv, python", [
    (["--to", "mla", "--kv-budget", "0.5"], dict(to="mla", kv_budget=0.5)),
    (["--to", "mqa"], dict(to="mqa")),
    (["--to", "gqa", "--kv-heads", "2", "--heal-steps", "5"], dict(to="gqa", kv_heads=2, heal_steps=5)),
    (["--to", "mla", "--kv-budget", "0.25", "--format", "deepseek_v3"],
     dict(to="mla", kv_budget=0.25, format="deepseek_v3")),
])  # fmt: skip
def test_cli_and_python_build_the_same_options(argv, python):
    args = build_parser().parse_args(["convert", "SRC", "OUT", *argv])
    cli = ConvertOptions.from_flat(**convert_options(args))
    assert dataclasses.asdict(cli) == dataclasses.asdict(ConvertOptions.from_flat(**python))
    assert cli.calibration.source == "teacher" and cli.reconstruction.steps == "auto"  # the best measured, in both


def test_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "serve", ("fastapi", "no_such_module_xyz"))
    with pytest.raises(
        extras.MissingExtraError, match=r"needs no_such_module_xyz: pip install 'hf-attn-patch\[serve\]'"
    ):
        extras.require("serve", "hf-attn serve")
    assert extras.available("plot") == (extras.missing("plot") == [])


def test_serve_without_its_extra_names_it_before_loading():
    """A plain install has no fastapi: `hf-attn serve` says which extra to install, in one line, no traceback."""
    code = (
        "import importlib.util, sys; real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n in ('fastapi', 'uvicorn') else real(n, *a)\n"
        "from hf_attn_patch.cli import main; main(['serve', 'no/such/model'])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == "error: hf-attn serve needs fastapi, uvicorn: pip install 'hf-attn-patch[serve]'"


def test_device_and_dtype_names():
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for bad, message in (("tpu", "device='tpu' is not a torch device"), ("meta", "only 'cpu' and 'cuda'")):
        with pytest.raises(ValueError, match=message):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda:1': this machine has 0 CUDA"):
            resolve_device("cuda:1")
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", torch.bfloat16, cpu) == torch.float32  # half matmuls are slow on the CPU
    assert resolve_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='fp8' is not one of"):
        resolve_dtype("fp8", torch.float32, cpu)


def test_engine_places_the_model_and_sizes_the_pool(one_torch_thread):
    model, tok = load_default()
    total, in_use = device_memory(torch.device("cpu"))
    share = min(1.0, (in_use + 256 * 2**20) / total)  # about 256 MiB of pool beside what the machine uses now
    engine = Engine(model, tok, device="cpu", dtype="bfloat16", max_batch_tokens=64, memory_utilization=share)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    budget = engine.memory_budget
    assert budget.activation_bytes > 0 and budget.in_use_bytes > 0  # measured, not assumed
    assert budget.kv_bytes == int(share * budget.device_bytes) - budget.in_use_bytes - budget.activation_bytes
    stats = engine.kv_stats()
    assert stats["blocks_total"] == engine.kv.num_blocks - 1 and stats["blocks_used"] == 0
    assert stats["bytes_total"] <= budget.kv_bytes < stats["bytes_total"] + engine.block_bytes  # whole blocks
    [out] = engine.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))
    assert len(out.token_ids) == 8
    with pytest.raises(ValueError, match="memory_utilization=1.5 must be a fraction"):
        kv_budget(model, 64, 4, 1.5)
    with pytest.raises(ValueError, match="memory_utilization=0.5 sizes the KV pool itself"):
        Engine(model, tok, max_memory=2**20, memory_utilization=0.5)
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        Engine(model, tok, memory_utilization=1e-9)


def test_health_reports_the_pool(one_torch_thread):
    model, tok = load_default()
    engine = Engine(model, tok, block_size=8, max_memory=2**20)
    with running(engine) as (port, _):
        status, before = http(port, "/health")
        assert status == 200 and before["kv_cache"]["blocks_used"] == 0
        assert (
            before["kv_cache"]["bytes_total"] == (before["kv_cache"]["blocks_total"] + 1) * engine.block_bytes <= 2**20
        )
        status, _ = http(port, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0})
        status, after = http(port, "/health")
        pool = after["kv_cache"]
        # the finished request's full blocks stay cached for prefix hits; nothing is referenced any more
        assert pool["blocks_used"] == 0 and pool["blocks_cached"] >= 2
        assert pool["blocks_free"] + pool["blocks_cached"] == pool["blocks_total"]
        assert json.dumps(pool)  # plain JSON


def test_unsupported_distributed_healing_is_refused_before_any_work(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="healing under DeepSpeed"):
        ConvertOptions.from_flat(to="mqa", heal_steps=1)
    ConvertOptions.from_flat(to="mqa")  # no healing: nothing to refuse
