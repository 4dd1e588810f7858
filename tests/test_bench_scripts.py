"""Every benchmark script that BENCHMARKS.md names still loads against the library: its imports resolve and, where
it takes options, `--help` parses; every command that BENCHMARKS.md, README.md, CONTRIBUTING.md and docs/ give a
script parses with that script's parser. A moved module, a renamed function or a dropped flag fails here, not in a
user's benchmark run. The layout rules of scripts/ are checked too: no sys.path edits, no script importing another
but the shared benchlib, results under scripts/results/ with plain file names."""

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
DOCUMENTED = [
    ROOT / "BENCHMARKS.md",
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
SCRIPTS = sorted(set(re.findall(r"scripts/(bench_\w+)\.py", BENCHMARKS)))
# The documented commands with their arguments: `... scripts/bench_x.py ARGS` in backticks, lines joined.
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.\.\.)?$")  # DIR, OUT, N, S...: a documented stand-in for a value
COMMANDS = [
    (m[0], ["1" if PLACEHOLDER.match(a) else a for a in shlex.split(m[1])])
    for path in DOCUMENTED
    for c in re.findall(r"`([^`]*scripts/bench_\w+\.py [^`]*)`", path.read_text())
    for m in re.findall(r"scripts/(bench_\w+)\.py (.*)", " ".join(c.split()))
]


class _Parsed(Exception):
    """Raised by the patched parse_args once the documented arguments parsed: the script stops before any work."""


def test_benchmarks_name_scripts_that_exist():
    assert len(SCRIPTS) >= 6, SCRIPTS  # the file really was parsed
    missing = [s for s in SCRIPTS if not (ROOT / "scripts" / f"{s}.py").exists()]
    assert not missing, f"BENCHMARKS.md names scripts that do not exist: {missing}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_loads(name, monkeypatch, capsys):
    path = ROOT / "scripts" / f"{name}.py"
    monkeypatch.syspath_prepend(str(path.parent))  # `python scripts/x.py` puts the folder first: benchlib is found
    text = path.read_text()
    if "argparse" not in text and "run_parts" not in text:  # positional sys.argv scripts: the module's imports only
        runpy.run_path(str(path), run_name="bench_import_check")
        return
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_info.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize(("name", "args"), COMMANDS, ids=[" ".join([n, *a])[:60] for n, a in COMMANDS])
def test_documented_command_parses(name, args, monkeypatch):
    """The script's own parser accepts the arguments the docs give it (flags renamed or dropped fail here). A part
    named alone (`scripts/bench_x.py PART` in a heading or a sentence) names that part: its --help must answer."""
    path = ROOT / "scripts" / f"{name}.py"
    if "argparse" not in path.read_text() and "run_parts" not in path.read_text():
        pytest.skip(f"{name} reads sys.argv positionally")
    if len(args) == 1 and not args[0].startswith("-"):
        monkeypatch.syspath_prepend(str(path.parent))
        monkeypatch.setattr(sys, "argv", [str(path), args[0], "--help"])
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(path), run_name="__main__")
        assert exit_info.value.code in (0, None)
        return
    monkeypatch.syspath_prepend(str(path.parent))
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(parser, argv=None, namespace=None):
        original(parser, args, namespace)  # exits 2 on an unknown flag or a bad value
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    with pytest.raises(_Parsed):
        runpy.run_path(str(path), run_name="__main__")


SCRIPTS_DIR = ROOT / "scripts"
PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def test_scripts_import_no_sibling_but_benchlib_and_edit_no_sys_path():
    bad = []
    for path in sorted(SCRIPTS_DIR.glob("*.py")):
        text = path.read_text()
        if re.search(r"sys\.path\.(insert|append)|site\.addsitedir|spec_from_file_location", text):
            bad.append(f"{path.name}: edits sys.path or loads a file as a module")
        siblings = {p.stem for p in SCRIPTS_DIR.glob("*.py")} - {"benchlib", path.stem}
        for name in re.findall(r"^\s*(?:from|import) (\w+)", text, re.MULTILINE):
            if name in siblings:
                bad.append(f"{path.name}: imports the script {name}")
    assert not bad, "\n".join(bad)


def test_results_live_in_one_folder_with_plain_names():
    tracked = [p for p in SCRIPTS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    loose = [p.name for p in tracked if p.parent == SCRIPTS_DIR and p.suffix in (".json", ".png", ".csv")]
    assert not loose, f"results outside scripts/results/: {loose}"
    odd = [str(p.relative_to(SCRIPTS_DIR)) for p in tracked if not PLAIN_NAME.match(p.name)]
    assert not odd, f"file names with spaces, commas, parentheses or '+': {odd}"
