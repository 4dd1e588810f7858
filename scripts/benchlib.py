"""What the benchmark scripts share: where the test data and the results live, the models and corpora they read,
a safetensors cache for tensors that cost minutes to make, result rows, plots and the parts of a script.

Scripts run as `python scripts/bench_x.py`, so this folder is on sys.path and `import benchlib` finds this module.
The test data (stories15M, the corpora, the offline evaluation tasks) lives beside the repository in ../shared.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CORPORA = SHARED / "corpora"
RESULTS = ROOT / "scripts" / "results"

# A script's parts: name -> (add its options to a parser, run it on the parsed options).
Part = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], object]]


def corpus(name: str) -> str:
    """A corpus of ../shared/corpora by file stem: wikitext2_test, tinyshakespeare, tinystories_sample."""
    return (CORPORA / f"{name}.txt").read_text(encoding="utf-8")


def wikitext() -> str:
    """The first 200,000 characters of WikiText-2 test: the held-out text of every SmolLM2 figure."""
    return corpus("wikitext2_test")[:200_000]


def model_dir(name: str) -> Path:
    """A saved model folder by name: smollm2 (the dequantized GGUF, built once), stories15m (../shared/models)."""
    if name == "smollm2":
        from hf_attn_patch.models.pretrained import smollm2_dir

        return smollm2_dir()
    return SHARED / "models" / name


def cached(path: Path, make: Callable[[], object], key: str = "t"):
    """make() -> a tensor, stored at path (safetensors, under `key`) and read from there the next time."""
    from safetensors.torch import load_file, save_file

    if path.exists():
        return load_file(path)[key]
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous()}, str(path) + ".part")
    Path(str(path) + ".part").rename(path)
    return value


def slug(label: str) -> str:
    """A plain file name for a row's label: lower case, letters, digits and underscores ('MLA 50%' -> 'mla_50')."""
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def write_rows(path: Path | str, rows, indent: int = 1) -> None:
    """Result rows as JSON at path (its folder made), rewritten whole: a stopped run keeps what it measured."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=indent) + "\n")


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def commit() -> str:
    """The short hash of the repository's HEAD (a row records the code that measured it)."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


@contextlib.contextmanager
def revision_checkout(revision: str) -> Iterator[Path]:
    """The code of git revision `revision` in a temporary worktree (removed afterwards), for a run of that code
    beside this tree's. A revision git does not know fails here, before any work."""
    with tempfile.TemporaryDirectory(prefix="revision-") as tmp:
        tree = Path(tmp) / "tree"
        add = ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), revision]
        done = subprocess.run(add, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"revision {revision!r}: {done.stderr.strip()}")
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)


def run_parts(doc: str, parts: dict[str, Part]) -> object:
    """Parse `PART [options]` and run that part: one parser per part, described by its run function's docstring."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=doc, formatter_class=raw)
    sub = parser.add_subparsers(dest="part", required=True, metavar="PART")
    for name, (configure, run) in parts.items():
        doc = inspect.cleandoc(run.__doc__ or name)
        summary = " ".join(doc.split("\n\n")[0].split())
        part = sub.add_parser(name, help=summary, description=doc, formatter_class=raw)
        configure(part)
        part.set_defaults(run=run, parser=part)
    args = parser.parse_args()
    return args.run(args)
