"""Our exports in llama.cpp: export -> llama.cpp's own convert_hf_to_gguf.py -> llama.cpp (llama-cpp-python) ->
logits and greedy tokens compared with stock transformers on the same checkpoint.

Needs llama-cpp-python and the llama.cpp sources of its sdist (`make test-llamacpp` builds and unpacks both; the
sources are found at $LLAMACPP_SRC or build/llamacpp/llama_cpp_python-*/vendor/llama.cpp). Skipped without them.
Everything runs in f32 (GGUF --outtype f32, f32 K/V cache) so the two engines differ by float rounding only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_attn_patch
from hf_attn_patch.converters.convert import convert

from ._fast import FAST

ROOT = Path(__file__).resolve().parents[1]
# `make test-llamacpp` sets LLAMACPP_SRC after installing everything: there a missing piece fails, never skips.
REQUIRED = "LLAMACPP_SRC" in os.environ
if REQUIRED:
    import llama_cpp
else:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make test-llamacpp)")


def _llama_cpp_source() -> Path | None:
    if REQUIRED:
        return Path(os.environ["LLAMACPP_SRC"])
    found = sorted(ROOT.glob("build/llamacpp/llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1] if found else None


SRC = _llama_cpp_source()
HAVE_SRC = SRC is not None and (SRC / "convert_hf_to_gguf.py").is_file()
if REQUIRED and not HAVE_SRC:
    raise FileNotFoundError(f"LLAMACPP_SRC={str(SRC)!r} has no convert_hf_to_gguf.py")
pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not HAVE_SRC, reason="llama.cpp sources not unpacked (make test-llamacpp)"),
]
GGML_TYPE_F32 = 0  # ggml_type enum: the K/V cache in f32, like transformers here

# stories260k's tokenizer.json is a BPE with merges; llama.cpp's converter writes it as a sentencepiece vocab whose
# scores split some words differently ("little" -> li t t le), so for stories only the token ids are compared
# (llama.cpp's tokenizer limitation, not the weights'). SmolLM2's byte-level BPE tokenizes identically.
# llama.cpp's DeepSeek converter (DeepseekV2Model.set_vocab) accepts only byte-level BPE tokenizers with a known
# pre-tokenizer hash; stories260k's sentencepiece-style tokenizer is refused for every DeepSeek architecture (its
# Llama converter takes it). This runs the DeepSeek converter unchanged except for that one step, which it takes
# from llama.cpp's own llama_hf path. SmolLM2 (byte-level BPE) goes through the unmodified command line.
DEEPSEEK_WITH_LLAMA_VOCAB = """
import sys
from pathlib import Path
import torch
import gguf
from conversion.deepseek import DeepseekV2Model

DeepseekV2Model.set_vocab = lambda self: self._set_vocab_llama_hf()  # the only change (comment above)
with torch.inference_mode():
    DeepseekV2Model(Path(sys.argv[1]), gguf.LlamaFileType.ALL_F32, Path(sys.argv[2])).write()
"""


def to_gguf(model_dir: Path, out: Path, llama_vocab: bool = False) -> Path:
    """llama.cpp's converter on a saved model folder, f32; the converter's own gguf-py comes first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(SRC / "gguf-py")])}
    if llama_vocab:
        cmd = [sys.executable, "-c", DEEPSEEK_WITH_LLAMA_VOCAB, str(model_dir), str(out)]
    else:
        cmd = [
            sys.executable,
            str(SRC / "convert_hf_to_gguf.py"),
            str(model_dir),
            "--outtype",
            "f32",
            "--outfile",
            str(out),
        ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def llama_cpp_logits(gguf_file: Path, ids: list[int]) -> tuple[np.ndarray, int]:
    """(logits [T, V] of one prompt, K/V cache bytes per token) from llama.cpp."""
    llm = llama_cpp.Llama(
        str(gguf_file),
        n_ctx=256,
        n_batch=256,
        logits_all=True,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        n_threads=2,
        verbose=False,
    )
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)]), llm


def llama_cpp_greedy(llm, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation: one token at a time through llama.cpp's own KV cache (its decode path)."""
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return out


def compare(model_dir: Path, gguf_file: Path, text: str, steps: int, atol: float, same_tokens: bool = True) -> dict:
    """Same token ids into stock transformers and llama.cpp: logits within atol, greedy tokens identical.
    same_tokens: llama.cpp's tokenizer from the GGUF also splits the text as the model's own tokenizer does."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text).input_ids
    with hf_attn_patch.unpatched():  # stock transformers: the reference an engine must reproduce
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
            greedy = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)[
                0, len(ids) :
            ].tolist()
    got, llm = llama_cpp_logits(gguf_file, ids)
    if same_tokens:
        plain = AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False).input_ids
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == plain
    err = float(np.abs(got - ref).max())
    assert err <= atol, f"llama.cpp logits differ from transformers by {err:.3g} > {atol:.3g}"
    assert llama_cpp_greedy(llm, ids, steps) == greedy
    return {"max_abs_logit_diff": err, "tokens": len(ids)}


# fp32 noise: unit roundoff 1.2e-7 x |logit| (<= 20) x matmuls a logit's error passes through (4 per layer:
# q/k/v, o, up/gate, down) x layers x safety 10. stories (5 layers): 4.8e-4; stories15m (6): 5.8e-4; SmolLM2 (30): 2.9e-3.
STORIES_ATOL, SMOLLM2_ATOL = 1.2e-7 * 20 * 4 * 5 * 10, 1.2e-7 * 20 * 4 * 30 * 10
STORIES15M_ATOL = 1.2e-7 * 20 * 4 * 6 * 10
STORIES15M = ROOT.parent / "shared" / "models" / "stories15m"  # llama2.c stories15M (MHA, 6 heads of 48, Llama-2 vocab)
PROMPT = "Once upon a time, there was a little girl named Lily. She liked to"


@pytest.mark.parametrize("target", [dict(to="gqa", kv_heads=2), dict(to="mqa", method="mean")])
def test_stock_llama_export_runs_in_llama_cpp(tmp_path, target):
    convert("default", tmp_path / "hf", calib_samples=4, **target, **FAST)
    gguf_file = to_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    compare(tmp_path / "hf", gguf_file, PROMPT, steps=24, atol=STORIES_ATOL, same_tokens=False)


def test_deepseek_v3_export_runs_in_llama_cpp(tmp_path):
    report = convert("default", tmp_path / "hf", to="mla", kv_budget=0.5, format="deepseek_v3", calib_samples=4, **FAST)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["n_group"] is None and config["q_lora_rank"] == config["hidden_size"]
    gguf_file = to_gguf(tmp_path / "hf", tmp_path / "model.gguf", llama_vocab=True)
    result = compare(tmp_path / "hf", gguf_file, PROMPT, steps=24, atol=STORIES_ATOL, same_tokens=False)
    assert report["deepseek_v3"]["q_lora"]["kl_to_q_proj_per_token"] < 1e-6  # measured 4e-10
    print(result)


@pytest.mark.smollm2
@pytest.mark.parametrize("target", [dict(to="mqa", method="mean"), dict(to="mla", kv_budget=0.5, format="deepseek_v3")])
def test_smollm2_exports_run_in_llama_cpp(tmp_path, target):
    """SmolLM2-135M through llama.cpp's unmodified command line, both export formats."""
    convert("smollm2", tmp_path / "hf", calib_samples=4, calib_len=128, **target, **FAST)
    gguf_file = to_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    print(
        compare(
            tmp_path / "hf",
            gguf_file,
            "The capital of France is Paris. The capital of Italy is",
            steps=16,
            atol=SMOLLM2_ATOL,
        )
    )


stories15m = pytest.mark.skipif(not STORIES15M.is_dir(), reason=f"{STORIES15M} is not there")


@stories15m
@pytest.mark.parametrize(
    "target",
    [dict(to="gqa", kv_heads=3), dict(to="gqa", kv_heads=2), dict(to="mqa")],
    ids=["gqa-6to3", "gqa-6to2", "mqa"],
)
def test_stories15m_stock_exports_run_in_llama_cpp(tmp_path, target):
    """A real MHA model's GQA / MQA exports (stock llama configs) through llama.cpp's unmodified command line."""
    convert(str(STORIES15M), tmp_path / "hf", calib_samples=4, **target, **FAST)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == target.get("kv_heads", 1)
    gguf_file = to_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    print(compare(tmp_path / "hf", gguf_file, PROMPT, steps=24, atol=STORIES15M_ATOL, same_tokens=False))


@stories15m
def test_stories15m_deepseek_v3_export_runs_in_llama_cpp(tmp_path):
    """stories15M MLA 50% as stock DeepSeek-V3 (the linear latent norm: latent rows of kv_a_proj scaled to ~1e-8,
    llama.cpp's f32 RMSNorm keeps them exact) through llama.cpp, its SentencePiece vocab by the Llama step."""
    report = convert(
        str(STORIES15M), tmp_path / "hf", to="mla", kv_budget=0.5, format="deepseek_v3", calib_samples=4, **FAST
    )
    ds = report["deepseek_v3"]
    assert ds["latent_norm"]["mode"] == "linear" and ds["kl_to_native_per_token"] < 1e-8  # measured ~1e-10
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-6 and config["q_lora_rank"] == config["hidden_size"]
    gguf_file = to_gguf(tmp_path / "hf", tmp_path / "model.gguf", llama_vocab=True)
    print(compare(tmp_path / "hf", gguf_file, PROMPT, steps=24, atol=STORIES15M_ATOL, same_tokens=False))
