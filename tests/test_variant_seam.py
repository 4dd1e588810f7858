"""A new attention variant enters through one door: its own module and one `register(Variant(...))`.

The variants here live in this file only (nothing in the package names them), each registered for its test's
duration; then the patched model construction, generate() with the dynamic and the paged cache, the
continuous-batching engine and the KV accounting all run it.
- shared_kv: keys and values share one projection, k = rope(x W_kv^T), v = x W_kv^T, cached as GQA caches them.
  Reference: stock Llama with k_proj = v_proj = W_kv, the same function written the stock way.
- one_latent: a cache layout of its own. One latent c = x W_c^T [d_c] per token is all a layer caches (its
  CacheSpec: one row of d_c values, nothing beside it), and keys and values are both expanded from it when attending
  (k = c W_k^T, v = c W_v^T per KV head; no positional encoding on the scores). Its paged forward writes c into
  the engine's pages and attends over them. Reference: the same model without a cache (generate(use_cache=False))."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_attn_patch import kv_cache_bytes, variants
from hf_attn_patch.attention import VariantAttention
from hf_attn_patch.attention.gqa import attention_function
from hf_attn_patch.attention import backend
from hf_attn_patch.attention.gqa import cache_spec as gqa_cache_spec
from hf_attn_patch.attention.gqa import GQASpec
from hf_attn_patch.attention.gqa import spec_fields as gqa_spec_fields
from hf_attn_patch.attention.rope import apply_rope
from hf_attn_patch.converters.methods.exact import rebuild
from hf_attn_patch.models.architectures import attention_spec
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
        out, weights = attention_function(self.config)(
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        return self.o_proj(out.reshape(batch, length, -1)), weights


ACCOUNTED = []


def cache_spec(config, layer_idx: int) -> variants.CacheSpec:
    """The cache holds rotated keys and plain values: what GQA holds, under this variant's name."""
    ACCOUNTED.append(layer_idx)
    gqa = gqa_cache_spec(config, layer_idx)
    return variants.CacheSpec("shared_kv", gqa.heads, gqa.key_dim, gqa.value_dim)


@pytest.fixture
def shared_kv(monkeypatch):
    """The variant registered through the public door, in a copy of the registry that is put back afterwards."""
    monkeypatch.setattr(variants, "_REGISTRY", dict(variants._REGISTRY))
    variants.register(variants.Variant("shared_kv", SharedKVAttention, GQASpec, gqa_spec_fields, cache_spec))
    source = tiny_model("llama")
    lifted = {}
    for name, module in source.named_modules():
        if name.endswith("self_attn"):
            module.v_proj.weight.data.copy_(module.k_proj.weight)  # the stock model computes the same function
            lifted[name] = {
                "q_proj.weight": module.q_proj.weight,
                "kv_proj.weight": module.k_proj.weight,
                "o_proj.weight": module.o_proj.weight,
            }
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
        variants.register(variants.Variant("shared_kv", nn.Identity, taken.spec, taken.spec_fields, taken.cache_spec))


@dataclass(frozen=True, kw_only=True)
class OneLatentSpec(GQASpec):
    """GQA's heads, plus the size of the one latent a layer caches (config field one_latent_dim)."""

    latent_dim: int

    def check(self) -> None:
        super().check()
        if not isinstance(self.latent_dim, int) or self.latent_dim < 1:
            raise ValueError(f"one_latent_dim={self.latent_dim!r} must be a positive integer")


def one_latent_spec_fields(config, layer_idx: int, arch, common: dict) -> dict:
    return dict(gqa_spec_fields(config, layer_idx, arch, common), latent_dim=getattr(config, "one_latent_dim", None))


class OneLatentAttention(VariantAttention):
    """x [B, T, D] -> q = x W_q^T [B, H, T, d]; c = x W_c^T [B, 1, T, d_c], cached; k = c W_k^T, v = c W_v^T
    [B, H_kv, S, d] expanded from every cached latent at each step."""

    variant = "one_latent"

    def __init__(self, config, layer_idx: int, spec):
        super().__init__(config, layer_idx, spec)
        h, h_kv, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.head_dim, self.num_key_value_groups, self.is_causal = d, h // h_kv, True
        self.scaling = spec.scaling if spec.scaling is not None else d**-0.5
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=False)
        self.c_proj = nn.Linear(spec.hidden_size, spec.latent_dim, bias=False)
        self.k_up = nn.Linear(spec.latent_dim, h_kv * d, bias=False)
        self.v_up = nn.Linear(spec.latent_dim, h_kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=False)

    def expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [b, 1, L, d_c] -> K, V [b, H_kv, L, d]."""
        b, _, length, _ = c.shape
        return tuple(up(c[:, 0]).view(b, length, -1, self.head_dim).transpose(1, 2) for up in (self.k_up, self.v_up))

    def layer_forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
        batch, length, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
        c = self.c_proj(hidden_states)[:, None]  # [B, 1, T, d_c]
        out = self.engine_forward(q, c)  # an engine step: write c into the pages, attend over them
        if out is not None:
            return self.o_proj(out.reshape(batch, length, -1)), None
        if cache is not None:
            c, _ = cache.update(c, c[..., :0], self.layer_idx)  # the latent is the key row; nothing beside it
        k, v = self.expand(c)
        out, weights = attention_function(self.config)(
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        return self.o_proj(out.reshape(batch, length, -1)), weights


def one_latent_cache_spec(config, layer_idx: int) -> variants.CacheSpec:
    """One row of d_c values per token, and nothing else: the latent cached once for keys and values."""
    return variants.CacheSpec("one_latent", 1, config.one_latent_dim, 0, fused=True)


def one_latent_paged_forward(module, q, c, context) -> torch.Tensor:
    """q [1, H, T, d], the new latents c [1, 1, T, d_c] -> [1, T, H, d]: c written at the step's slots, then per
    segment (a chunk, or a group of decodes) its latent pages read, expanded to K and V and attended with SDPA."""
    meta, layer = context.metadata, module.layer_idx
    storage = backend.write_new(context, layer, c, c[..., :0])
    group = meta.layer_groups[layer]
    out = q.new_empty((q.shape[2], q.shape[1], module.head_dim))
    for i, (selector, blocks, visible) in enumerate(backend.segments(meta, group, None)):
        latent, _ = backend.read_segment(storage, meta, (group, None, i), blocks, visible.shape[-1])  # [b, 1, L, d_c]
        k, v = module.expand(latent.to(q.dtype))
        chunk = isinstance(selector, slice)
        queries = q[:, :, selector] if chunk else q[0][:, selector].transpose(0, 1)[:, :, None]
        o = F.scaled_dot_product_attention(queries, k, v, attn_mask=visible, scale=module.scaling, enable_gqa=True)
        out[selector] = o[0].transpose(0, 1) if chunk else o[:, :, 0]
    return out[None]


@pytest.fixture
def one_latent(monkeypatch):
    monkeypatch.setattr(variants, "_REGISTRY", dict(variants._REGISTRY))
    variant = variants.Variant(
        "one_latent",
        OneLatentAttention,
        OneLatentSpec,
        one_latent_spec_fields,
        one_latent_cache_spec,
        paged_forward=one_latent_paged_forward,
    )
    variants.register(variant)
    source = tiny_model("llama")
    torch.manual_seed(0)
    d_c = 12
    lifted = {}
    for name, module in source.named_modules():
        if name.endswith("self_attn"):
            lifted[name] = {"q_proj.weight": module.q_proj.weight, "o_proj.weight": module.o_proj.weight,
                            "c_proj.weight": torch.randn(d_c, module.q_proj.in_features) * 0.2,
                            "k_up.weight": torch.randn(module.k_proj.out_features, d_c) * 0.4,
                            "v_up.weight": torch.randn(module.v_proj.out_features, d_c) * 0.4}  # fmt: skip
    model = rebuild(source, "one_latent", {"one_latent_dim": d_c}, lifted)
    assert all(isinstance(m.self_attn, OneLatentAttention) for m in model.model.layers)
    return model


def test_a_variant_with_its_own_cache_layout_runs_everywhere(one_latent, padded_batch, stories, one_torch_thread):
    model = one_latent
    ids, mask = padded_batch
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, use_cache=False, **kw)  # every step recomputes the whole prefix
    assert torch.equal(model.generate(ids, **kw), reference)  # the dynamic cache holds the latents
    assert torch.equal(model.generate(ids, cache_implementation="paged_kv", **kw), reference)

    engine = Engine(model, stories[1], block_size=4, max_batch_tokens=16)
    prompts = [[5, 9, 13, 22, 40, 7, 8, 9, 10, 11], [3, 4, 5]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    model.generation_config.eos_token_id = None  # as the engine's ignore_eos
    for prompt, out in zip(prompts, outputs):
        alone = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0, use_cache=False
        )
        assert out.token_ids == alone[0, len(prompt) :].tolist()
    storage = engine.runner.storage[0]
    assert storage.keys.shape[-1] == 12 and storage.values.shape[-1] == 0  # one row of d_c values per token

    config = model.config
    assert kv_cache_bytes(config, 5, dtype=torch.float32) == 5 * config.num_hidden_layers * 12 * 4  # cached once

    assert all(type(layer.self_attn.spec) is OneLatentSpec for layer in model.model.layers)  # its own fields
    bad = copy.deepcopy(config)
    bad.one_latent_dim = 0
    with pytest.raises(ValueError, match="one_latent_dim=0 must be a positive integer"):
        attention_spec(bad)
