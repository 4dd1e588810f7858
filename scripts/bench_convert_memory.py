"""Peak memory and time of convert() (layer-streamed) against depth, on synthetic deep sources.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_convert_memory.py [--depths 30,60,120] [--width 576]
        [--targets mla,mqa] [--tokenizer smollm2|default] [--json rows.json]

Per depth, a Llama source of random weights (SmolLM2-135M's shape at --width 576, scripts/bench_stream_memory.py's
synthetic_config; vocab 49152 with SmolLM2's tokenizer, or 512 with the embedded stories260k's) is written layer by
layer into a temporary folder by a subprocess. Each conversion then runs in a fresh subprocess: first a 2-layer
source of the same width is converted (imports and allocator pools warmed), the RSS is read (the floor), then the
deep one: MLA 50% (kv_budget 0.5, uniform ranks) or MQA, calibration on 8 windows of 128 tokens of the package's
text, 2 reconstruction steps per layer. Printed: the source's bytes, the report's peak_rss_mb (VmHWM over the
stages), peak - floor, their ratios to the source's bytes (target: peak_rss_mb <= 40% of the source), seconds and
seconds per layer. Memory flat and time linear in depth: peak - floor stays near constant, seconds / layer too.
Sensitivity ranks (the default for MLA by budget) stream too, with O(L^2) layer reads: not run here at 120 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stream_memory import build_source, rss_mb  # noqa: E402

TARGETS = {"mla": dict(to="mla", kv_budget=0.5, rank_allocation="uniform"), "mqa": dict(to="mqa")}
COMMON = dict(calib_source="text", calib_samples=8, calib_len=128, reconstruct_steps=2)


def tokenizer_folder(name: str) -> tuple[Path, int]:
    """(folder holding the tokenizer's files, its vocabulary size)."""
    if name == "smollm2":
        from hf_attn_patch.models.pretrained import smollm2_dir

        return smollm2_dir(), 49152
    from hf_attn_patch.models.pretrained import DEFAULT_MODEL_DIR

    return Path(DEFAULT_MODEL_DIR), 512


def make_source(folder: Path, depth: int, width: int, tokenizer: str) -> int:
    """A synthetic source with the tokenizer's files beside it; returns its weights' bytes."""
    tok, vocab = tokenizer_folder(tokenizer)
    size = build_source(folder, depth, width, vocab)
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or f.suffix == ".jinja":
            shutil.copy(f, folder / f.name)
    return size


def child(args) -> None:
    """Warm-up conversion, floor, measured conversion, in this fresh process; prints one JSON line."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from hf_attn_patch.converters.convert import convert

    options = {**TARGETS[args.target], **COMMON}
    with tempfile.TemporaryDirectory() as tmp:
        convert(args.warmup, Path(tmp) / "warm", **options)
        floor = rss_mb()
        start = time.perf_counter()
        report = convert(args.folder, Path(tmp) / "out", **options)
    seconds = time.perf_counter() - start
    print(json.dumps({"floor_mb": floor, "peak_rss_mb": report["peak_rss_mb"], "seconds": seconds,
                      "stages": report["stages"], "activations": report["activations"]}))  # fmt: skip


def run_child(target: str, folder: Path, warmup: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", "--target", target, "--folder", str(folder), "--warmup", str(warmup)]
    # a fixed mmap threshold: glibc otherwise raises it after each large free, so freed tensors stay in the heap or
    # go back to the OS depending on the history, and the RSS floor and peak wander by ~10 MB from run to run
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{target} conversion failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(depths: list[int], width: int, targets: list[str], tokenizer: str, printer=print) -> list[dict]:
    """Rows {layers, target, source_bytes, floor_mb, peak_rss_mb, seconds, ...} per depth and target."""
    rows = []
    for depth in depths:
        root = Path(tempfile.mkdtemp(prefix="bench-convert-"))
        try:
            size = make_source(root / "src", depth, width, tokenizer)
            make_source(root / "warm", 2, width, tokenizer)
            for target in targets:
                r = run_child(target, root / "src", root / "warm")
                row = {"layers": depth, "target": target, "source_bytes": size, **r}
                rows.append(row)
                mb = size / 2**20
                printer(f"{depth:>6} {target:>4} {mb:>9.0f} | {r['floor_mb']:>6.0f} {r['peak_rss_mb']:>8.0f} "
                        f"{r['peak_rss_mb'] - r['floor_mb']:>10.0f} {r['peak_rss_mb'] / mb:>10.2f} "
                        f"{(r['peak_rss_mb'] - r['floor_mb']) / mb:>12.3f} | {r['seconds']:>7.1f} "
                        f"{r['seconds'] / depth:>7.2f} | {r['activations']['placement']}")  # fmt: skip
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="30,60,120")
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--targets", default="mla,mqa")
    parser.add_argument("--tokenizer", choices=["smollm2", "default"], default="smollm2")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.width % 64 or args.width < 192:
        parser.error(f"--width={args.width} must be a multiple of 64, at least 192")
    print(f"width {args.width}, fp32, {COMMON}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}; MB")
    print(f"{'layers':>6} {'to':>4} {'source':>9} | {'floor':>6} {'peak':>8} {'peak-floor':>10} {'peak/src':>10} "
          f"{'(p-f)/src':>12} | {'s':>7} {'s/layer':>7} | activations")  # fmt: skip
    rows = measure([int(d) for d in args.depths.split(",")], args.width, args.targets.split(","), args.tokenizer)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
