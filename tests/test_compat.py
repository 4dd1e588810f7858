"""The supported transformers range (hf_attn_patch/compat.py): the import's version gate, and each shim resolving
on the installed minor."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.models.llama import modeling_llama

from hf_attn_patch import compat
from hf_attn_patch.attention import GroupedQueryAttention

from .conftest import tiny_model


def _import_with_version(version: str) -> subprocess.CompletedProcess:
    """`import hf_attn_patch` in a fresh interpreter whose transformers reports `version`."""
    code = f"import transformers; transformers.__version__ = {version!r}; import hf_attn_patch; print('imported')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_below_the_floor_the_import_refuses_with_the_pip_line():
    done = _import_with_version("5.18.2")
    assert done.returncode != 0 and "imported" not in done.stdout
    assert "ImportError: hf_attn_patch needs transformers 5.19 or newer, found 5.18.2" in done.stderr
    assert 'pip install "transformers>=5.19,<6"' in done.stderr


def test_above_the_newest_tested_minor_the_import_warns_once_and_runs():
    done = _import_with_version("5.99.0")
    assert done.returncode == 0 and done.stdout == "imported\n", done.stderr
    assert done.stderr.count("UserWarning") == 1
    assert "tested with transformers 5.19 to 5.25, found 5.99.0" in done.stderr


def test_the_gate_warns_once_per_version(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.26.1")
    monkeypatch.setattr(compat, "_warned_newer", set())
    with pytest.warns(UserWarning, match="found 5.26.1") as caught:
        compat.check_transformers_version()
        compat.check_transformers_version()
    assert len(caught) == 1
    with pytest.raises(ImportError, match=r'pip install "transformers>=5\.19,<6"'):
        compat.check_transformers_version("4.57.6")


@pytest.mark.parametrize("version", ["5.19.0", "5.22.2", "5.25.0", "5.25.3"])
def test_supported_minors_pass_silently(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_transformers_version(version)


def test_the_import_has_no_deprecation_message():
    """Nothing of ours passes the cache under a deprecated name while patching (transformers 5.24+ renamed it)."""
    done = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", "import hf_attn_patch"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "deprecated" not in done.stderr, done.stderr


def test_the_cache_keyword_is_the_installed_one():
    """CACHE is the name transformers' forward, masks and generate() take, and get_cache reads outputs by it."""
    assert compat.CACHE in inspect.signature(modeling_llama.LlamaModel.forward).parameters
    assert compat.CACHE in inspect.signature(modeling_llama.LlamaForCausalLM.prepare_inputs_for_generation).parameters
    model = tiny_model("llama", attention_variant="gqa")
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = compat.get_cache(out)
        assert isinstance(cache, Cache) and cache.get_seq_length() == 5
        model(ids[:, :1], **compat.cache_kwarg(cache))  # our attention reads it under that name and appends
    assert cache.get_seq_length() == 6


def test_generate_takes_cache_on_every_supported_minor():
    model = tiny_model("llama", attention_variant="gqa")
    ids = torch.randint(3, 97, (2, 4))
    cache = DynamicCache(config=model.config)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    out = model.generate(ids, cache=cache, **kw)
    assert cache.get_seq_length() == out.shape[1] - 1  # the cache we passed was the one filled
    assert torch.equal(out, model.generate(ids, **kw))


def test_constructor_signature_sees_through_wrapped_constructors():
    """Stock attention classes' own (config, layer_idx) signature, even where `kernels` wraps __init__ (5.25+)."""
    stock = modeling_llama.LlamaAttention.original  # the patch's stand-in keeps the stock class
    assert "layer_idx" in compat.constructor_signature(stock).parameters
    model = tiny_model("llama", attention_variant="gqa")
    layers = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(a, GroupedQueryAttention) for a in layers)
    assert [a.layer_idx for a in layers] == list(range(len(layers)))


def test_the_placeholder_layer_sits_in_a_cache():
    cache = Cache(layers=[compat.placeholder_cache_layer(), compat.placeholder_cache_layer()])
    assert len(cache.layers) == 2
