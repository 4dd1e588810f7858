"""Every benchmark script that BENCHMARKS.md names still loads against the library: its imports resolve and, where
it takes options, `--help` parses. A moved module or a renamed function fails here, not in a user's benchmark run."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = (ROOT / "BENCHMARKS.md").read_text()
SCRIPTS = sorted(set(re.findall(r"scripts/(bench_\w+)\.py", BENCHMARKS)))
# The documented commands with their arguments: `... scripts/bench_x.py ARGS` in backticks, lines joined.
COMMANDS = [(m[0], shlex.split(m[1])) for c in re.findall(r"`([^`]*scripts/bench_\w+\.py [^`]*)`", BENCHMARKS)
            for m in re.findall(r"scripts/(bench_\w+)\.py (.*)", " ".join(c.split()))]


class _Parsed(Exception):
    """Raised by the patched parse_args once the documented arguments parsed: the script stops before any work."""


def test_benchmarks_name_scripts_that_exist():
    assert len(SCRIPTS) >= 10, SCRIPTS  # the file really was parsed
    missing = [s for s in SCRIPTS if not (ROOT / "scripts" / f"{s}.py").exists()]
    assert not missing, f"BENCHMARKS.md names scripts that do not exist: {missing}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_loads(name, monkeypatch, capsys):
    path = ROOT / "scripts" / f"{name}.py"
    monkeypatch.syspath_prepend(str(path.parent))  # scripts import their siblings (bench_schemas, ...)
    text = path.read_text()
    if "argparse" not in text:  # positional sys.argv scripts: the module's imports only
        runpy.run_path(str(path), run_name="bench_import_check")
        return
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_info.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize(("name", "args"), COMMANDS, ids=[" ".join([n, *a])[:60] for n, a in COMMANDS])
def test_documented_command_parses(name, args, monkeypatch):
    """The script's own parser accepts the arguments BENCHMARKS.md gives it (flags renamed or dropped fail here)."""
    path = ROOT / "scripts" / f"{name}.py"
    if "argparse" not in path.read_text():
        pytest.skip(f"{name} reads sys.argv positionally")
    monkeypatch.syspath_prepend(str(path.parent))
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(parser, argv=None, namespace=None):
        original(parser, args, namespace)  # exits 2 on an unknown flag or a bad value
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    with pytest.raises(_Parsed):
        runpy.run_path(str(path), run_name="__main__")
