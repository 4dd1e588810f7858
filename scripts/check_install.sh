#!/usr/bin/env bash
# The package as users install it: the wheel in a fresh venv with no extras, then with [serve], then over each
# supported transformers a user may already have.
#
#   bash scripts/check_install.sh        # from the repository root, after `make install` (its venv builds the wheel)
#
# Plain install: `import hf_attn_patch`; `hf-attn demo`; a small healed conversion that writes the model without
# matplotlib (the plot is skipped with a warning); structured output in generate() (llguidance is a core dependency);
# `hf-attn serve` and `hf-attn eval --tasks` name the extra to install in one line, with no traceback.
# With [serve]: `hf-attn serve` answers a real request from the openai client (the dev venv's) on localhost.
# Then, for transformers 5.19, 5.22 and 5.25 installed first, `pip install` of the wheel leaves it as it is.
# Runs outside the repository, so the checkout's sources cannot stand in for the installed package.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEV_PY="$ROOT/.venv/bin/python"
WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
step() { printf '\n== %s\n' "$*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }

step "wheel and a fresh venv (torch==2.13.0, then the wheel without extras)"
"$DEV_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$ROOT"
WHEEL="$(ls "$WORK"/dist/hf_attn_patch-*.whl)"
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
HF="$WORK/venv/bin/hf-attn"
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q "$WHEEL"
cd "$WORK"
for module in matplotlib fastapi uvicorn lm_eval datasets xgrammar triton; do
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is not None)" \
        || fail "$module is installed by a plain install"
done

step "import hf_attn_patch"
"$PY" -c "import hf_attn_patch; assert hf_attn_patch.is_patched(); print('patched, version', hf_attn_patch.__version__)"

step "hf-attn demo"
"$HF" demo --max-new-tokens 24 > demo.log 2>&1 || { cat demo.log; fail "hf-attn demo"; }
grep -q "identical text from all three: True" demo.log || fail "demo: the three attentions differ"
grep -q "valid: True" demo.log || fail "demo: the JSON output"
tail -n 4 demo.log

step "a healed conversion without matplotlib writes the model"
"$HF" convert default healed --to mla --kv-budget 0.5 --heal-steps 2 --heal-layerwise-steps 2 \
    --reconstruct-steps 5 --calib-samples 8 --calib-len 64 > convert.log 2>&1 || { cat convert.log; fail "convert"; }
[ -f healed/model.safetensors ] && [ -f healed/conversion_report.json ] || fail "the healed model was not written"
[ ! -e healed/heal_curve.png ] || fail "heal_curve.png written without matplotlib?"
grep -q "heal_curve.png" convert.log || fail "no warning that the plot is skipped"
"$PY" -c "
import hf_attn_patch, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained('healed')
assert type(m.model.layers[0].self_attn).__name__ == 'MultiHeadLatentAttention'
print('loads:', type(m.model.layers[0].self_attn).__name__)"

step "structured output in generate() (core)"
"$PY" - <<'PY'
import json
import hf_attn_patch
from hf_attn_patch.models import load_default
model, tok = load_default()
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
          "additionalProperties": False}
batch = tok(["Once upon a time"], return_tensors="pt")
out = model.generate(**batch, max_new_tokens=40, do_sample=False, tokenizer=tok,
                     response_format={"type": "json_schema", "json_schema": {"schema": schema}})
text = tok.decode(out[0, batch.input_ids.shape[1]:], skip_special_tokens=True)
import jsonschema
jsonschema.validate(json.loads(text), schema)
print("valid JSON:", text)
PY

step "commands of missing extras name them in one line"
expect_hint() {  # $1: extra; the rest: the command
    local extra="$1"; shift
    if "$@" > hint.log 2>&1; then cat hint.log; fail "$* succeeded without the $extra extra"; fi
    cat hint.log
    [ "$(wc -l < hint.log)" -eq 1 ] || fail "$*: more than one line"
    grep -q "pip install 'hf-attn-patch\[$extra\]'" hint.log || fail "$*: no install hint for [$extra]"
}
expect_hint serve "$HF" serve default
expect_hint eval "$HF" eval default --tasks hellaswag
expect_hint convert "$HF" convert default never --to mqa --calib-data wikitext:wikitext-2-raw-v1
[ ! -e never ] || fail "convert wrote OUT although an extra was missing"

step "with [serve]: a real request from the openai client"
"$PY" -m pip install -q "$WHEEL[serve]"
PORT="$("$DEV_PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
"$HF" serve default --port "$PORT" --device cpu --kv-memory 16777216 > serve.log 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 120); do
    "$DEV_PY" -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())" \
        "http://127.0.0.1:$PORT/health" > health.json 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat serve.log; fail "the server exited"; }
    sleep 1
done
cat health.json; echo
"$DEV_PY" - "$PORT" <<'PY'
import sys
import openai
client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused", max_retries=0)
reply = client.completions.create(model="default", prompt="Once upon a time", max_tokens=16, temperature=0)
assert reply.choices[0].text and reply.usage.completion_tokens == 16, reply
print("completion:", repr(reply.choices[0].text))
PY
head -n 1 serve.log
kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""

step "a user's transformers is kept: the oldest, a middle and the newest supported minor"
for minor in 5.19 5.22 5.25; do
    "$PY" -m pip install -q "transformers==$minor.*"
    "$PY" -m pip uninstall -q -y hf-attn-patch
    "$PY" -m pip install -q "$WHEEL"
    "$PY" - "$minor" <<'PY'
import subprocess, sys
import transformers
assert transformers.__version__.startswith(sys.argv[1] + "."), f"transformers {transformers.__version__}: not kept"
# the import patches without a deprecation message (FutureWarning or transformers' own log line)
done = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", "import hf_attn_patch"],
                      capture_output=True, text=True)
assert done.returncode == 0 and "deprecated" not in done.stderr, done.stderr
print("kept transformers", transformers.__version__, "and imports cleanly")
PY
done
echo; echo "install check: passed"
