"""The docs run: every ```python block of README.md and docs/*.md is executed on the embedded models.

Blocks of one file run in order in one namespace (a later block may use the names an earlier one defined), in a
temporary working directory, so `out/...` paths land there. A block is left out, or run differently, when the line
just before its opening fence is a marker comment (CONTRIBUTING.md documents them):

    <!-- requires: gpu -->      needs a CUDA GPU: not run here
    <!-- requires: hub -->      needs the Hugging Face Hub (download or upload): not run here
    <!-- requires: server -->   talks to `hf-attn serve default`: the test starts that server on a free port and
                                points the block's http://127.0.0.1:8000 at it

A file's blocks are skipped as a whole only when all of them are marked; any other marker is an error, so a typo
cannot silently switch a block off. The same files are checked for words that describe how the project was built
rather than the product.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIPPED = {"gpu", "hub"}
MARKERS = SKIPPED | {"server"}
FENCE = re.compile(r"^```python\s*$")
MARKER = re.compile(r"^<!--\s*requires:\s*([\w-]+)\s*-->\s*$")
SERVE_URL = "http://127.0.0.1:8000"


def blocks(path: Path) -> list[tuple[int, str | None, str]]:
    """(line number of the fence, marker or None, code) of every ```python block of a markdown file."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i
            marker = MARKER.match(lines[i - 1].strip()) if i else None
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{path.name}:{start + 1}: a ```python block is never closed")
            found.append((start + 1, marker.group(1) if marker else None, "\n".join(body) + "\n"))
        i += 1
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """`hf-attn serve default` on a free port (started on first use, stopped after the module) -> its base URL."""
    state: dict = {}

    def start() -> str:
        if "url" not in state:
            port = _free_port()
            cmd = [
                sys.executable,
                "-m",
                "hf_attn_patch.cli",
                "serve",
                "default",
                "--port",
                str(port),
                "--device",
                "cpu",
            ]
            state["proc"] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180  # import + model load on a loaded 2-core machine
            while True:
                if state["proc"].poll() is not None:
                    raise AssertionError(
                        f"hf-attn serve default exited: {state['proc'].stderr.read().decode()[-2000:]}"
                    )
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise AssertionError("hf-attn serve default did not answer /health within 180 s") from None
                    time.sleep(0.5)
            state["url"] = url
        return state["url"]

    yield start
    if "proc" in state:
        state["proc"].terminate()
        state["proc"].wait(timeout=60)


def test_every_page_is_found():
    names = {p.name for p in DOCS}
    expected = {
        "README.md",
        "quickstart.md",
        "paged-cache.md",
        "speculative.md",
        "structured-output.md",
        "serving.md",
        "conversion.md",
        "conversion-methods.md",
        "exports.md",
        "kernels.md",
        "architecture.md",
    }
    assert expected <= names, sorted(expected - names)
    assert any(marker is None for _, marker, _ in blocks(ROOT / "README.md")), "README.md has no runnable example"


def test_markers_are_known():
    for path in DOCS:
        text = path.read_text().splitlines()
        for n, line in enumerate(text, 1):
            m = re.match(r"^<!--\s*requires:", line.strip())
            if m:
                marker = MARKER.match(line.strip())
                assert marker and marker.group(1) in MARKERS, f"{path.name}:{n}: unknown marker {line.strip()!r}"
                assert n < len(text) and FENCE.match(text[n]), f"{path.name}:{n}: a marker must precede ```python"


def test_readme_and_benchmarks_are_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 300


USER_FACING = [*DOCS, ROOT / "BENCHMARKS.md", ROOT / "CONTRIBUTING.md"]
# How the project was built is not what users read about. CONTRIBUTING.md may name the test data outside the
# repository (../shared); nothing else may.
BUILD_WORDS = [re.compile(p, re.IGNORECASE) for p in (r"\bsessions?\b", r"\bissue \d+", r"\bthe seed\b")]
SHARED = re.compile(r"\.\./shared")


@pytest.mark.parametrize("path", USER_FACING, ids=lambda p: p.name)
def test_no_words_of_how_it_was_built(path):
    if not path.exists():
        pytest.skip(f"{path.name} not written")
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for pattern in BUILD_WORDS + ([] if path.name == "CONTRIBUTING.md" else [SHARED]):
            if pattern.search(line):
                bad.append(f"{path.name}:{n}: {line.strip()[:120]}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path, monkeypatch, server):
    found = blocks(path)
    runnable = [(n, marker, code) for n, marker, code in found if marker not in SKIPPED]
    if not runnable:
        pytest.skip(f"{path.name}: no runnable ```python block")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for n, marker, code in runnable:
        if marker == "server":
            assert SERVE_URL in code, f"{path.name}:{n}: a server block must use {SERVE_URL}"
            code = code.replace(SERVE_URL, server())
        try:
            exec(compile(code, f"{path.name}:{n}", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{path.name}, the ```python block at line {n} failed: {err!r}") from err
    # Blocks may import the patch; tests after this one expect it applied, as every other test module leaves it.
    import hf_attn_patch

    assert hf_attn_patch.is_patched()
