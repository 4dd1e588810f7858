"""hf-attn eval: perplexity and KL against a reference, on the embedded model and its exact variants."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_attn_patch.evaluation.perplexity import evaluate, windows_of
from hf_attn_patch.converters.targets.exact import to_variant
from hf_attn_patch.models import load_default

from .test_models import CORPORA

# fp32 forward of stories260k: rounding of eps 1.2e-7 grows like sqrt(64) per reduction of the hidden size,
# over 5 layers, on logits of size <= 20: 1.2e-7 * 8 * 5 * 20 ~ 1e-4 (measured max |d logit| 2.5e-5).
LOGIT_TOL = 1e-4
pytestmark = pytest.mark.skipif(not CORPORA.exists(), reason="../shared/corpora not present")
TEXT = CORPORA / "tinystories_sample.txt"


def test_perplexity_and_kl():
    model, tokenizer = load_default()
    windows = windows_of(TEXT.read_text()[:20_000], tokenizer, ctx=128, max_tokens=512)
    assert windows.shape == (4, 128)
    own = evaluate(model, windows, reference=model, progress=False)
    assert 2 < own.perplexity < 10 and own.tokens == 4 * 127
    assert own.kl_to_reference == 0.0  # the same logits: every float64 term p (log p - log p) is exactly 0
    mla = evaluate(to_variant(model, "mla"), windows, reference=model, progress=False)
    # The exact MLA re-expression moves logits by at most m = LOGIT_TOL (measured 2.5e-5). Then |d log p| <= 2m, so
    # |log ppl ratio| <= 2m, and KL ~ Var_p(d log p) / 2 <= m^2 / 2 (measured 1.4e-7 and 1.4e-12).
    assert mla.perplexity == pytest.approx(own.perplexity, rel=2 * LOGIT_TOL)
    assert mla.kl_to_reference < LOGIT_TOL**2 / 2
    shuffled = model.__class__(model.config).eval()  # random weights: far from the reference
    far = evaluate(shuffled, windows, reference=model, progress=False)
    assert far.kl_to_reference > 1.0 and far.perplexity > 100


def test_bad_windows_are_named():
    _, tokenizer = load_default()
    with pytest.raises(ValueError, match="ctx=1 must be"):
        windows_of("Once upon a time", tokenizer, ctx=1, max_tokens=None)
    with pytest.raises(ValueError, match="fewer than one window of ctx=512"):
        windows_of("Once upon a time", tokenizer, ctx=512, max_tokens=None)


def test_eval_cli(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "hf_attn_patch.cli",
        "eval",
        "default",
        "--text",
        str(TEXT),
        "--ctx",
        "128",
        "--max-tokens",
        "256",
        "--reference",
        "default",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["windows"] == 2 and report["kl_to_reference"] == 0.0  # the same model: exactly 0 in float64
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    result = subprocess.run(cmd[:6] + [str(empty)], capture_output=True, text=True)
    assert result.returncode != 0 and "is empty" in result.stderr
    result = subprocess.run(cmd[:4] + [str(tmp_path / "nope")] + cmd[5:7], capture_output=True, text=True)
    assert result.returncode != 0 and "is not a model folder" in result.stderr
