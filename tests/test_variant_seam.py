"""A new attention variant enters through one door: its own module and one `register(Variant(...))`.

The variant here lives in this file only (nothing in the package names it): keys and values share one projection,
k = rope(x W_kv^T), v = x W_kv^T. It is registered for the test's duration, and then the patched model construction,
generate() with the dynamic and the paged cache, the continuous-batching engine and the KV accounting all run it.
Reference: stock Llama with k_proj = v_proj = W_kv, the same function written the stock way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_attn_patch import kv_cache_bytes, variants
from hf_attn_patch.attention import VariantAttention
from hf_attn_patch.attention.gqa import attention_function
from hf_attn_patch.attention.gqa import cached_values as gqa_cached_values
from hf_attn_patch.attention.gqa import spec_fields as gqa_spec_fields
from hf_attn_patch.attention.gqa import validate as gqa_validate
from hf_attn_patch.attention.rope import apply_rope
from hf_attn_patch.converters.methods.exact import rebuild
from hf_attn_patch.engine import Engine, SamplingParams

from .conftest import TINY_ATOL, tiny_model


class SharedKVAttention(VariantAttention):
    """x [B, T, D] -> q = rope(x W_q^T) [B, H, T, d], s = x W_kv^T [B, H_kv, T, d]; k = rope(s), v = s."""

    variant = "shared_kv"

    def __init__(self, config, layer_idx: int, spec):
        super().__init__(config, layer_idx, spec)
        h, h_kv, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.head_dim, self.num_key_value_groups, self.is_causal = d, h // h_kv, True
        self.scaling = spec.scaling if spec.scaling is not None else d**-0.5
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=False)
        self.kv_proj = nn.Linear(spec.hidden_size, h_kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=False)

    def layer_forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
        batch, length, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
        v = self.kv_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rope(q, cos, sin), apply_rope(v, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, weights = attention_function(self.config)(self, q, k, v, attention_mask, dropout=0.0,
                                                       scaling=self.scaling, **kwargs)  # fmt: skip
        return self.o_proj(out.reshape(batch, length, -1)), weights


ACCOUNTED = []


def cached_values(config, layer_idx: int):
    """The cache holds rotated keys and plain values: what GQA holds, under this variant's name."""
    ACCOUNTED.append(layer_idx)
    return "shared_kv", gqa_cached_values(config, layer_idx)[1]


@pytest.fixture
def shared_kv(monkeypatch):
    """The variant registered through the public door, in a copy of the registry that is put back afterwards."""
    monkeypatch.setattr(variants, "_REGISTRY", dict(variants._REGISTRY))
    variants.register(variants.Variant("shared_kv", SharedKVAttention, gqa_spec_fields, gqa_validate, cached_values))
    source = tiny_model("llama")
    lifted = {}
    for name, module in source.named_modules():
        if name.endswith("self_attn"):
            module.v_proj.weight.data.copy_(module.k_proj.weight)  # the stock model computes the same function
            lifted[name] = {"q_proj.weight": module.q_proj.weight, "kv_proj.weight": module.k_proj.weight,
                            "o_proj.weight": module.o_proj.weight}  # fmt: skip
    model = rebuild(source, "shared_kv", {}, lifted)
    layers = [m for m in model.modules() if isinstance(m, SharedKVAttention)]
    assert len(layers) == model.config.num_hidden_layers  # the registered module is what the patched build made
    return source, model


def test_a_registered_variant_runs_everywhere(shared_kv, padded_batch, stories, one_torch_thread):
    source, model = shared_kv
    ids, mask = padded_batch
    with torch.no_grad():
        expected, got = source(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=TINY_ATOL, rtol=0)

    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    reference = source.generate(ids, **kw)
    assert torch.equal(model.generate(ids, **kw), reference)
    assert torch.equal(model.generate(ids, cache_implementation="paged_kv", **kw), reference)

    engine = Engine(model, stories[1], block_size=4, max_batch_tokens=16)
    prompts = [[5, 9, 13, 22, 40, 7, 8, 9, 10, 11], [3, 4, 5]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    source.generation_config.eos_token_id = None  # as the engine's ignore_eos
    for prompt, out in zip(prompts, outputs):
        stock = source.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert out.token_ids == stock[0, len(prompt) :].tolist()

    ACCOUNTED.clear()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim  # keys and values, fp32
    assert kv_cache_bytes(config, 5, dtype=torch.float32) == 5 * per_token * 4
    assert ACCOUNTED  # the KV accounting asked the variant, not a table of names


def test_the_registry_refuses_a_second_variant_under_a_taken_name(shared_kv):
    taken = variants.variant_of("shared_kv")
    with pytest.raises(ValueError, match="'shared_kv' is registered twice"):
        variants.register(variants.Variant("shared_kv", nn.Identity, taken.spec_fields, taken.validate,
                                           taken.cached_values))
