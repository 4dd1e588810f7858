"""Our MLA's decode steps over PagedKVCache go through kernels.mla_decode on CUDA by block table (gate opened here
on CPU)."""

from __future__ import annotations

import pytest
import torch

import hf_attn_patch.kernels.ops as kernels
from hf_attn_patch import PagedKVCache
from hf_attn_patch.cache import metadata

from .conftest import tiny_model
from .test_paged_cache import ragged

MLA = dict(attention_variant="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize(
    "model_type, overrides", [("llama", MLA), ("deepseek_v3", {})], ids=["llama-mla", "deepseek_v3"]
)
def test_mla_decode_goes_through_the_kernel_entry(model_type, overrides, monkeypatch):
    model = tiny_model(model_type, **overrides)
    ids, mask = ragged(lengths=(9, 4, 13))
    kw = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=6, do_sample=False)
    expected = model.generate(ids, **kw)
    calls = []
    original = kernels.mla_decode

    def spy(*args, **kwargs):
        calls.append(kwargs["block_size"])
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "mla_decode", spy)
    monkeypatch.setattr(metadata, "use_kernels", lambda query: True)
    model.set_attn_implementation("paged_kv")  # decode steps then hand attention the pages and their metadata
    out = model.generate(ids, cache=PagedKVCache(model.config, block_size=4), **kw)
    assert torch.equal(out, expected)
    assert len(calls) == 5 * model.config.num_hidden_layers  # every decode step, every layer
    assert set(calls) == {4}  # block tables of the cache's block size (left padding is not stored)


def test_cpu_keeps_the_reference_path():
    assert metadata.use_kernels(torch.zeros(1)) is False
