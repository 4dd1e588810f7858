#!/usr/bin/env bash
# One-shot GPU check of hf_attn_patch.kernels: the CUDA test grid, the engine's paged path, the kernel benchmark.
#
#   bash scripts/gpu_check.sh            # from the repository root, on a machine with one CUDA GPU
#
# The GPU machine has no internet: this script installs nothing. It uses this repository's code and whatever
# torch / triton / flash-attn / pytest the machine's Python ($PYTHON, default python3) has. Anything else it
# needs must be carried onto the machine, e.g. a folder made here with
# `pip install --target build/gpu_site pytest` and passed as GPU_SITE=build/gpu_site (prepended to PYTHONPATH).
#
# The package is not installed there, so the script builds a throw-away import tree under a temporary folder:
# hf_attn_patch/ with every entry of the repo's package linked in (kernels/ comes through its hf_attn_patch/kernels
# link), plus converters/ where setuptools' package-dir would put it. If the full package cannot be imported (it needs transformers 5.19 to 5.25), the tree gets an
# empty hf_attn_patch/__init__.py and only the kernels are checked (the paged_kv wiring test skips itself).
#
# Output: the test summary and the benchmark tables in $OUT/gpu_check_results.md if $OUT is set, else
# ./gpu_check_results.md. Bounded to finish in under 10 minutes on one H200: tests 270 s, engine and serving check 90 s,
# converter 120 s, benchmark 120 s, then sharded healing in what is left (600 s, one device call).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac  # survives the cd
RESULTS="${OUT:-.}/gpu_check_results.md"
mkdir -p "$(dirname "$RESULTS")"
RESULTS="$(cd "$(dirname "$RESULTS")" && pwd)/$(basename "$RESULTS")"
TREE="$(mktemp -d)"
trap 'rm -rf "$TREE"' EXIT

mkdir -p "$TREE/hf_attn_patch"
for entry in "$ROOT"/hf_attn_patch/*; do
    ln -s "$entry" "$TREE/hf_attn_patch/$(basename "$entry")"
done
ln -s "$ROOT/converters" "$TREE/hf_attn_patch/converters"
for entry in tests scripts pyproject.toml; do ln -s "$ROOT/$entry" "$TREE/$entry"; done
# Everything runs from the tree: `python -m` puts the working directory first on sys.path, and the repo root's
# hf_attn_patch/ (without kernels/) must not be the one found.
export PYTHONPATH="${GPU_SITE:+$GPU_SITE:}$TREE${PYTHONPATH:+:$PYTHONPATH}"
cd "$TREE"

MODE=full
if ! "$PYTHON" -c "import hf_attn_patch" 2>"$TREE/import_error.txt"; then
    MODE=kernels-only
    rm "$TREE/hf_attn_patch/__init__.py"
    echo '"""gpu_check.sh stub: the full package is not importable here; only hf_attn_patch.kernels is."""' \
        >"$TREE/hf_attn_patch/__init__.py"
fi

{
    echo "# GPU check ($(date -u +%Y-%m-%d), mode: $MODE)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
    "$PYTHON" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
    "$PYTHON" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
    if [ "$MODE" = kernels-only ]; then echo "full package not importable: $(tail -1 "$TREE/import_error.txt")"; fi
    echo '```'
    echo
} >"$RESULTS"

echo "## Tests: tests/test_kernels_backends.py (CUDA grid)" >>"$RESULTS"
echo '```' >>"$RESULTS"
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    EXTRA=()
    [ "$MODE" = kernels-only ] && EXTRA=(--noconftest)  # tests/conftest.py imports transformers
    timeout 270 "$PYTHON" -m pytest -q -p no:cacheprovider "${EXTRA[@]}" tests/test_kernels_backends.py 2>&1 \
        | tee "$TREE/pytest.txt" | tail -3
    echo "exit status ${PIPESTATUS[0]} (124: stopped at the 270 s limit)"
    grep -E "^(FAILED|ERROR)" "$TREE/pytest.txt" | head -20
else
    echo "pytest is not importable: tests not run (carry it: GPU_SITE, see the header)"
fi >>"$RESULTS" 2>&1
echo '```' >>"$RESULTS"
echo >>"$RESULTS"

echo "## Engine on the GPU: scripts/gpu_engine_check.py (kernels at block granularity, outputs = generate(); serving: device, dtype, KV pool by memory share, one request)" >>"$RESULTS"
echo '```' >>"$RESULTS"
if [ "$MODE" = full ]; then
    timeout 90 "$PYTHON" scripts/gpu_engine_check.py 2>&1 | grep -v "^Loading" | tail -8
    echo "exit status ${PIPESTATUS[0]} (124: stopped at the 90 s limit)"
else
    echo "skipped: the full package is not importable here"
fi >>"$RESULTS" 2>&1
echo '```' >>"$RESULTS"
echo >>"$RESULTS"

echo "## Converter on the GPU: tests/test_convert_cuda.py (model passes on cuda, results as good as the CPU's)" >>"$RESULTS"
echo '```' >>"$RESULTS"
if [ "$MODE" = full ] && "$PYTHON" -c "import pytest" 2>/dev/null; then
    timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_convert_cuda.py 2>&1 | tail -8
    echo "exit status ${PIPESTATUS[0]} (124: stopped at the 120 s limit)"
else
    echo "skipped: the full package or pytest is not importable here"
fi >>"$RESULTS" 2>&1
echo '```' >>"$RESULTS"
echo >>"$RESULTS"

timeout 120 "$PYTHON" scripts/bench_kernels.py gpu gpu --out "$TREE/bench.md" >"$TREE/bench.log" 2>&1
STATUS=$?
if [ -s "$TREE/bench.md" ]; then
    cat "$TREE/bench.md" >>"$RESULTS"
else
    { echo "benchmark failed (exit status $STATUS; 124: stopped at the 120 s limit); its last lines:"; echo '```'
      tail -20 "$TREE/bench.log"; echo '```'; } >>"$RESULTS"
fi
cat "$RESULTS"
echo "results written to $RESULTS"

# Sharded healing on the GPUs (FSDP2 over NCCL, one process per GPU, at most 2): tests/test_heal_fsdp.py's CUDA run.
# Appended after the results above were printed; it takes what is left of the 600 s (at most 180 s, none under 60 s).
LEFT=$((590 - SECONDS)); [ "$LEFT" -gt 180 ] && LEFT=180
{
    echo
    echo "## Sharded healing on the GPU: tests/test_heal_fsdp.py -k cuda (FSDP2 = data parallel, exact resume)"
    echo '```'
    if [ "$MODE" != full ] || ! "$PYTHON" -c "import pytest, accelerate" 2>/dev/null; then
        echo "skipped: the full package, pytest or accelerate is not importable here"
    elif [ "$LEFT" -lt 60 ]; then
        echo "skipped: ${LEFT} s left of the 600 s bound"
    else
        timeout "$LEFT" "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_heal_fsdp.py -k cuda 2>&1 | tail -8
        echo "exit status ${PIPESTATUS[0]} (124: stopped at the ${LEFT} s limit)"
    fi
    echo '```'
} >>"$RESULTS" 2>&1
tail -12 "$RESULTS"
