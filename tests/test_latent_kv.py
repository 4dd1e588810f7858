"""Latent K/V attention (pre-RoPE latents, exact RoPE on rebuilt keys): its exact form against the source, every
cache and the engine, the blockwise decode path, KV accounting, and the metric-weighted closed form."""

from __future__ import annotations

import pytest
import torch

import hf_attn_patch
from hf_attn_patch.attention import LatentKVAttention, latent_kv
from hf_attn_patch.compat import cache_kwarg, get_cache
from hf_attn_patch.converters.targets.exact import to_variant
from hf_attn_patch.converters.methods.latent_kv import key_metric, latent_kv_layer, rotation, weighted_low_rank
from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.models.architectures import AttentionShape

from .conftest import TINY_ATOL, tiny_model

ARCHES = ["llama", "qwen2", "qwen3", "mistral", "gpt_neox", "gpt2"]  # GQA, biases, QK norm, window, partial, no RoPE


def _latent(model_type, **overrides):
    source = tiny_model(model_type, **overrides)
    converted = to_variant(source, "latent_kv")
    layers = [m for m in converted.modules() if isinstance(m, LatentKVAttention)]
    assert len(layers) == converted.config.num_hidden_layers  # the patched module really is what runs
    return source, converted


@pytest.mark.parametrize("model_type", ARCHES)
def test_exact_form_matches_the_source(model_type, padded_batch):
    source, converted = _latent(model_type)
    ids, mask = padded_batch
    with torch.no_grad():
        expected = source(ids, attention_mask=mask).logits
        got = converted(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], atol=TINY_ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ARCHES)
def test_generate_is_token_identical_with_every_cache(model_type, padded_batch, one_torch_thread):
    """Decode steps rotate the cached keys by cache index (left padding shifts queries and keys alike)."""
    source, converted = _latent(model_type)
    ids, mask = padded_batch
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = source.generate(ids, **kw)
    assert torch.equal(converted.generate(ids, **kw), expected)
    assert torch.equal(converted.generate(ids, cache_implementation="paged_kv", **kw), expected)


def test_cache_holds_the_latents_only():
    source, converted = _latent("llama")
    config = converted.config
    out = converted(torch.randint(3, 90, (1, 7)), use_cache=True)
    cache = get_cache(out)
    k, v = cache.layers[0].keys, cache.layers[0].values
    assert k.shape == (1, 1, 7, config.latent_key_rank) and v.shape == (1, 1, 7, config.latent_value_rank)
    per_token = config.num_hidden_layers * (config.latent_key_rank + config.latent_value_rank)
    assert hf_attn_patch.kv_cache_bytes(config, 7, dtype=torch.float32) == 7 * per_token * 4


def test_engine_matches_generate(stories):
    """Chunked prefill and batched decodes of different lengths (queries rotated at their own positions)."""
    _, converted = _latent("llama")
    engine = Engine(converted, stories[1], block_size=4, max_batch_tokens=16)
    prompts = [[5, 9, 13, 22, 40, 7, 8, 9, 10, 11], [3, 4, 5], [50, 60, 70, 80, 90, 11, 12]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        reference = converted.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.token_ids == reference[0, len(prompt) :].tolist()


def test_blockwise_decode_equals_dense_attention(monkeypatch):
    """The online softmax over key blocks (decode) equals one softmax over all rebuilt keys (fp32 rounding)."""
    _, converted = _latent("llama")
    ids = torch.randint(3, 90, (2, 23))
    with torch.no_grad():
        past = get_cache(converted(ids[:, :-1], use_cache=True))
        monkeypatch.setattr(latent_kv, "KEY_BLOCK", 5)  # 22 cached tokens in 5 blocks, the last one partial
        blockwise = converted(ids[:, -1:], **cache_kwarg(past)).logits
        dense = converted(ids).logits[:, -1:]
    torch.testing.assert_close(blockwise, dense, atol=TINY_ATOL, rtol=0)


def test_rotation_is_the_models_rope():
    """rotation(delta) k equals apply_rope at position delta (rotate_half layout, partial rotary dims untouched)."""
    from hf_attn_patch.attention.rope import apply_rope

    model = tiny_model("gpt_neox")
    shape = AttentionShape.of(model.config)
    k = torch.randn(shape.head_dim, dtype=torch.float64)
    deltas = torch.tensor([0.0, 3.0, 17.0])
    theta = torch.tensor(shape.frequencies, dtype=torch.float64)
    angles = torch.cat((deltas[:, None] * theta, deltas[:, None] * theta), -1)
    rotated = apply_rope(k.expand(1, 1, 3, -1), angles.cos()[None], angles.sin()[None])[0, 0]
    torch.testing.assert_close(rotation(shape, deltas) @ k, rotated)


def test_weighted_fit_is_optimal_in_its_metric():
    """The metric-weighted PCA beats the plain one in the weighted error, and the error falls with the rank."""
    torch.manual_seed(0)
    w = torch.randn(12, 20, dtype=torch.float64)
    x = torch.randn(500, 20, dtype=torch.float64) * torch.linspace(0.1, 3, 20)
    cov = x.T @ x / 500
    metric = torch.stack([torch.diag(torch.linspace(0.01, 10, 6, dtype=torch.float64))] * 2)
    root = torch.block_diag(*[m.sqrt() for m in metric])

    def weighted_error(b, a):
        e = root @ (w - b @ a)
        return float(torch.trace(e @ cov @ e.T))

    errors = [weighted_error(*weighted_low_rank(w, cov, metric, r)[:2]) for r in (2, 4, 8, 12)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-9
    plain = weighted_low_rank(w, cov, torch.eye(6, dtype=torch.float64).expand(2, 6, 6), 4)
    assert weighted_error(*weighted_low_rank(w, cov, metric, 4)[:2]) < weighted_error(*plain[:2])


def test_exact_key_heads_keep_their_keys():
    model = tiny_model("llama", num_key_value_heads=3)
    shape = AttentionShape.of(model.config)
    attn = model.model.layers[0].self_attn
    w = shape.arch.split_heads(attn)
    x = torch.randn(64, shape.hidden, dtype=torch.float64)
    cov = torch.eye(shape.hidden + 1, dtype=torch.float64)
    cov[: shape.hidden, : shape.hidden] = x.T @ x / 64
    d = shape.head_dim
    state = latent_kv_layer(w, shape, cov, key_rank=d + 2, value_rank=6, context=64, exact_key_heads=(1,))
    rebuilt = state["k_b_proj.weight"].double() @ state["k_a_proj.weight"].double()
    torch.testing.assert_close(rebuilt[d : 2 * d], w.k_w[d : 2 * d].double(), atol=1e-6, rtol=0)
    assert not torch.allclose(rebuilt[:d], w.k_w[:d].double(), atol=1e-3)  # the others are rank 2: lossy
    with pytest.raises(ValueError, match="latent_key_rank=4 is below"):
        latent_kv_layer(w, shape, cov, key_rank=4, value_rank=6, context=64, exact_key_heads=(1,))


def test_key_metric_sees_slow_frequencies_keep_their_direction():
    """A fast RoPE pair averages to its mean energy (isotropic 2x2 block); over a short context a slow pair keeps
    the query's direction (the metric stays anisotropic)."""
    model = tiny_model("llama")
    shape = AttentionShape.of(model.config)
    w = shape.arch.split_heads(model.model.layers[0].self_attn)
    cov = torch.eye(shape.hidden + 1, dtype=torch.float64)
    m = key_metric(w, shape, cov, context=4096)[0]
    half = shape.half
    fast = m[[0, half]][:, [0, half]]
    assert abs(float(fast[0, 1])) < 0.05 * float(fast[0, 0]) and abs(float(fast[0, 0] - fast[1, 1])) < 0.05 * float(
        fast[0, 0]
    )


@pytest.mark.parametrize("field, value, message", [
    ("latent_key_rank", 0, "latent_key_rank=0 must be a positive integer"),
    ("latent_value_rank", 10_000, "latent_value_rank=10000 exceeds"),
])  # fmt: skip
def test_bad_ranks_are_refused(field, value, message):
    import transformers

    config = tiny_model("llama").config.to_dict()
    config.update({"attention_variant": "latent_kv", "latent_key_rank": 8, "latent_value_rank": 8, field: value})
    with pytest.raises(ValueError, match=message):
        transformers.LlamaConfig.from_dict(config)


# -- the converter --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    (dict(to="latent_kv"), "to='latent_kv' needs kv_budget"),
    (dict(to="latent_kv", kv_budget=0.5, key_share=1.0), r"key_share=1.0 must be a fraction in \(0, 1\)"),
    (dict(to="latent_kv", kv_budget=0.5, kv_lora_rank=8), "kv_lora_rank=8 applies to to='mla' only"),
    (dict(to="mla", kv_budget=0.5, key_share=0.5), "key_share=0.5 applies to to='latent_kv' only"),
    (dict(to="latent_kv", kv_budget=0.5, rank_allocation="sensitivity"), "to='latent_kv' takes 'uniform' or"),
    (dict(to="latent_kv", kv_budget=0.5, format="stock"), "format='stock' exists for to='gqa' / 'mqa' only, not to='latent_kv'"),
])  # fmt: skip
def test_conversion_options_are_checked(options, message):
    from hf_attn_patch.converters.options import ConvertOptions

    with pytest.raises(ValueError, match=message):
        ConvertOptions.from_flat(**options)


def test_convert_writes_a_latent_kv_model_that_loads_and_generates(tmp_path, stories):
    """stories260k (MHA, 8 heads) at half the KV bytes; retrieval allocation with a threshold every head passes:
    the exact key heads are paid for within the same total."""
    from transformers import AutoModelForCausalLM

    from hf_attn_patch.converters.convert import convert
    from hf_attn_patch.converters.stages import retrieval

    from ._fast import FAST

    model, tok = stories
    options = {**FAST, "reconstruct_steps": 0}
    uniform = convert("default", tmp_path / "uniform", to="latent_kv", kv_budget=0.5, **options)
    assert uniform["kv_ratio"] == 0.5 and uniform["format"] == "native"
    section = uniform["latent_kv"]
    assert section["latent_key_rank_per_layer"][0] + section["latent_value_rank_per_layer"][0] == 32  # 0.5 * 2 * 32
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "uniform").eval()
    assert all(isinstance(converted.model.layers[i].self_attn, LatentKVAttention) for i in range(5))
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    out = converted.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, converted.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="paged_kv"))
    with torch.no_grad():  # the closed form is close to the source, not equal (half the KV values)
        kl = torch.nn.functional.kl_div(
            converted(ids).logits.log_softmax(-1),
            model(ids).logits.log_softmax(-1),
            log_target=True,
            reduction="batchmean",
        )
    assert 0 < float(kl) < 2.0

    original = retrieval.COPY_THRESHOLD
    retrieval.COPY_THRESHOLD = -1.0  # every KV head counts as a copy head: as many exact keys as the budget allows
    try:
        report = convert(
            "default", tmp_path / "retrieval", to="latent_kv", kv_budget=0.5, rank_allocation="retrieval", **options
        )
    finally:
        retrieval.COPY_THRESHOLD = original
    budgets = report["budgets"]
    assert budgets["exact_key_heads"] and budgets["values_per_token"] <= 5 * 32
    assert report["kv_ratio"] <= 0.5


def test_speculative_decoding_is_exact(one_torch_thread):
    """Prompt lookup and a draft model both crop the latent cache after rejected drafts: greedy output unchanged."""
    source, converted = _latent("llama")
    ids = torch.tensor([[5, 9, 13, 22, 5, 9, 13, 22, 5, 9], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = source.generate(ids, **kw)
    assert torch.equal(converted.generate(ids, prompt_lookup_num_tokens=3, **kw), expected)
    assert torch.equal(converted.generate(ids, assistant_model=source, **kw), expected)


def test_reconstruction_and_healing_train_the_latent_layers(tmp_path):
    """The layerwise fit and distillation run on latent_kv layers (every parameter is a plain Linear) and move
    the weights away from the closed form."""
    from safetensors.torch import load_file

    from hf_attn_patch.converters.convert import convert

    closed = convert(
        "default",
        tmp_path / "closed",
        to="latent_kv",
        kv_budget=0.5,
        calib_source="text",
        calib_samples=4,
        reconstruct_steps=0,
    )
    fitted = convert(
        "default",
        tmp_path / "fitted",
        to="latent_kv",
        kv_budget=0.5,
        calib_source="text",
        calib_samples=4,
        reconstruct_steps=3,
        heal_steps=2,
        heal_data="calib",
    )
    assert fitted["layerwise"]["reconstruct_steps"] == 3 and fitted["heal"]
    a, b = load_file(tmp_path / "closed" / "model.safetensors"), load_file(tmp_path / "fitted" / "model.safetensors")
    name = "model.layers.0.self_attn.k_a_proj.weight"
    assert a[name].shape == b[name].shape and not torch.equal(a[name], b[name])
    assert closed["kv_ratio"] == fitted["kv_ratio"] == 0.5
