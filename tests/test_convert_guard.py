"""hf-attn convert never loses data: OUT may not be, contain or lie inside the source; a file OUT, an unwritable OUT,
pickled weights and options the target would ignore are refused before any work; killed runs leave no staging
folder behind for long; the finished folder has ordinary permissions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_attn_patch.converters.convert import convert
from hf_attn_patch.models.pretrained import DEFAULT_MODEL_DIR

from ._fast import FAST


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under folder -> (size, mtime_ns): what must not change."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
    }


@pytest.fixture
def source(tmp_path):
    """A copy of the embedded model as an ordinary source folder."""
    folder = tmp_path / "src"
    folder.mkdir()
    for file in Path(DEFAULT_MODEL_DIR).iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_out_that_overlaps_the_source_is_refused(source, where):
    before = snapshot(source.parent)
    out = {"same": source, "inside": source / "converted", "parent": source.parent}[where]
    relation = {"same": "is", "inside": "lies inside", "parent": "contains"}[where]
    with pytest.raises(ValueError, match=rf"out='{out}' {relation} the source '{source}'"):
        convert(str(source), out, to="mla", kv_budget=0.5, overwrite=True, **FAST)
    assert snapshot(source.parent) == before


def test_cli_refuses_converting_a_model_onto_itself(source):
    before = snapshot(source)
    cmd = [
        sys.executable,
        "-m",
        "hf_attn_patch.cli",
        "convert",
        str(source),
        str(source),
        "--to",
        "mla",
        "--kv-budget",
        "0.5",
        "--overwrite",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and f"out='{source}' is the source" in result.stderr, result.stderr
    assert snapshot(source) == before


def test_the_embedded_default_is_a_source_too():
    with pytest.raises(ValueError, match="lies inside the source"):
        convert("default", Path(DEFAULT_MODEL_DIR) / "out", to="mqa", overwrite=True, **FAST)


def test_file_or_unwritable_out_is_refused_before_work(tmp_path):
    file = tmp_path / "a_file"
    file.write_text("keep me")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        convert("default", file, to="mqa", overwrite=True, **FAST)
    assert file.read_text() == "keep me"
    with pytest.raises(ValueError, match="cannot be written: .*a_file.* is not a writable folder"):
        convert("default", file / "out", to="mqa", **FAST)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_parent_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot be written"):
        convert("default", locked / "out", to="mqa", **FAST)


def test_pickled_bin_only_source_is_refused_with_the_fix(tmp_path):
    folder = tmp_path / "bin_model"
    folder.mkdir()
    (folder / "config.json").write_text((Path(DEFAULT_MODEL_DIR) / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match=r"only pickled \.bin weights.*arbitrary code.*save_pretrained"):
        convert(str(folder), tmp_path / "out", to="mqa", **FAST)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            dict(to="gqa", kv_heads=2, kv_budget=0.5),
            "kv_budget=0.5 applies to to='mla' / 'latent_kv' only, not to='gqa'",
        ),
        (dict(to="mqa", kv_lora_rank=8), "kv_lora_rank=8 applies to to='mla' only"),
        (dict(to="mqa", rope_dim=8), "rope_dim=8 applies to to='mla' only"),
        (dict(to="mla", kv_budget=0.5, kv_heads=2), "kv_heads=2 applies to to='gqa' / 'mqa' only"),
        (dict(to="mla", kv_budget=0.5, regroup=False), "regroup=False applies to .* not to='mla'"),
        (dict(to="mqa", method="mean", regroup=False), "regroup=False applies to .* method='mean'"),
        (dict(to="mqa", heal_lr=1e-3), r"heal_lr=0.001 applies to healing only: set heal_steps"),
        (dict(to="mqa", heal_train="all"), "heal_train='all' applies to healing only"),
        (dict(to="mqa", checkpoint_dir="x"), "checkpoint_dir='x' applies to healing only"),
    ],
)
def test_options_the_target_would_ignore_are_refused(options, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        convert("default", tmp_path / "out", **options, **FAST)
    assert not (tmp_path / "out").exists()


def test_stale_staging_of_a_dead_process_is_removed_and_out_is_ordinary(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.partial-{int(dead.stdout)}-abc123"  # the pid of a process that has exited
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    live = tmp_path / f".out.partial-{os.getpid()}-def456"  # a conversion still running (this process)
    live.mkdir()
    convert("default", tmp_path / "out", to="mqa", method="mean", **FAST)
    assert not stale.exists() and live.exists()
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")] == [live.name]
