"""models/fast_linear.py and kernels/cpu_linear.py: every nn.Linear of a model built while patched runs the packed
oneDNN product (and the tests fail if it silently does not), within a derived tolerance of F.linear, greedy-identical
to the stock model in generate(), speculative verification and the engine; the named fallbacks (no bf16 on this CPU,
gradients, disabled) run F.linear; unpatch() / restore() give back plain nn.Linear."""

from __future__ import annotations

import logging
import threading
from copy import deepcopy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_attn_patch
from hf_attn_patch.converters import convert as convert_module
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.engine import Engine, SamplingParams
from hf_attn_patch.kernels.cpu_linear import onednn_linear_unsupported, pack_linear_weight, packed_linear
from hf_attn_patch.models import fast_linear
from hf_attn_patch.models.fast_linear import FastLinear

from ._fast import FAST
from .conftest import STORIES_ATOL

pytestmark = pytest.mark.skipif(onednn_linear_unsupported(torch.float32) is not None, reason="no oneDNN in torch")
BF16 = onednn_linear_unsupported(torch.bfloat16) is None
EPS_FP32 = torch.finfo(torch.float32).eps


def linear_count(model) -> int:
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())


def small_llama(dtype=torch.float32):
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.fixture(autouse=True)
def fresh_counts():
    fast_linear.reset_counts()
    yield
    fast_linear.set_enabled(True)
    fast_linear.reset_counts()


@pytest.mark.parametrize("rows", [1, 3, 5, 8, 33])
def test_packed_product_matches_f_linear(rows):
    torch.manual_seed(rows)
    k = 200
    weight, bias, x = torch.randn(70, k), torch.randn(70), torch.randn(2, rows, k)
    out = packed_linear(x, pack_linear_weight(weight), bias)
    # fp32, one sum of K = 200 products in another order: |error| <= K x eps x sum|x_k w_k| (worst case; in practice
    # ~sqrt(K) x eps x that), with sum|x_k w_k| <= ~K x E|x||w| = 200 x 2/pi
    bound = k * EPS_FP32 * (x.abs() @ weight.abs().T).max().item()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), atol=bound, rtol=0)
    if BF16:
        xb, wb, bb = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
        outb = packed_linear(xb, pack_linear_weight(wb), bb)
        ref = torch.nn.functional.linear(xb, wb, bb)
        # both accumulate in fp32 and round once to bf16: at most one bf16 ulp apart (2^-8 relative, 2^-7 margin)
        torch.testing.assert_close(outb.float(), ref.float(), atol=1e-3, rtol=2**-7)


def test_model_built_while_patched_runs_every_linear_packed():
    """The test that fails when the fast path falls back silently: every Linear call of a no-grad forward packed."""
    model = small_llama()
    assert linear_count(model) == 15 and fast_linear.installed(model) == 15  # 2 x (q k v o gate up down) + lm_head
    assert all(type(m) is FastLinear for m in model.modules() if isinstance(m, torch.nn.Linear))
    ids = torch.randint(0, 300, (2, 7))
    with torch.no_grad():
        ours = model(ids).logits
    assert fast_linear.counts() == {fast_linear.PACKED: 15}
    fast_linear.reset_counts()
    with torch.no_grad():
        model(ids[:1, :1])  # one fp32 row times small weights: MKL's gemv, by choice
    assert fast_linear.counts() == {fast_linear.GEMV: 15}
    fast_linear.reset_counts()
    with torch.no_grad():
        model(ids)
    fast_linear.set_enabled(False)
    with torch.no_grad():
        stock = model(ids).logits
    assert fast_linear.counts() == {fast_linear.PACKED: 15, fast_linear.DISABLED: 15}
    # fp32, sums of <= 96 terms in another order, 2 layers, |logits| < 1: the tiny configs' TINY_ATOL bound, 1e-5
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)


def test_disabled_blocks_nest_and_hold_in_every_thread():
    model = small_llama()
    ids = torch.randint(0, 300, (2, 7))
    seen = []
    with torch.no_grad(), fast_linear.disabled():
        with fast_linear.disabled():
            model(ids)
        assert not fast_linear.is_enabled()  # the outer block is still open
        worker = threading.Thread(target=lambda: seen.append(fast_linear.is_enabled()))
        worker.start()
        worker.join()
        model(ids)
    assert seen == [False] and fast_linear.is_enabled()
    with torch.no_grad():
        model(ids)
    assert fast_linear.counts() == {fast_linear.DISABLED: 30, fast_linear.PACKED: 15}


def test_convert_runs_f_linear(tmp_path, monkeypatch):
    """A conversion's passes run torch's F.linear, whatever the switch: its weights are bitwise those of the stock
    kernels (tests/test_streamed_exact.py compares them with the in-memory reference, which runs F.linear too)."""
    seen, calibrate = [], convert_module.calibrate

    def spy(*args, **kwargs):
        seen.append(fast_linear.is_enabled())
        return calibrate(*args, **kwargs)

    monkeypatch.setattr(convert_module, "calibrate", spy)
    convert("default", tmp_path / "out", to="gqa", kv_heads=1, **FAST)
    assert seen == [False] and fast_linear.is_enabled()


def test_weight_changes_are_followed():
    model = small_llama()
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(3, 64)
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(-2)  # in place: the version counter moves, the packed copy is made again
        torch.testing.assert_close(layer(x), -2 * first, atol=1e-5, rtol=0)
        layer.weight = torch.nn.Parameter(torch.zeros_like(layer.weight))  # a new tensor
        assert layer(x).abs().max() == 0
    model.to(torch.bfloat16 if BF16 else torch.float64)
    with torch.no_grad():
        assert layer(x.to(layer.weight.dtype)).dtype == layer.weight.dtype


def test_gradients_run_f_linear_and_backpropagate():
    model = small_llama()
    ids = torch.randint(0, 300, (1, 5))
    model(ids).logits.sum().backward()
    assert fast_linear.counts() == {fast_linear.GRAD: 15}
    assert model.lm_head.weight.grad is not None


def test_missing_bf16_is_logged_and_runs_f_linear(monkeypatch, caplog):
    """The CPU-feature fallback: without oneDNN bf16 kernels a bf16 model runs F.linear and the log names it."""
    reason = "this CPU has no bf16 oneDNN kernels (AVX512-BF16 / AMX / AVX512)"
    monkeypatch.setattr(
        fast_linear, "onednn_linear_unsupported", lambda dtype: reason if dtype == torch.bfloat16 else None
    )
    fast_linear.reset_counts()
    model = small_llama(torch.bfloat16)
    ids = torch.randint(0, 300, (1, 6))
    with caplog.at_level(logging.WARNING, logger=fast_linear.__name__), torch.no_grad():
        out = model(ids).logits
        model(ids)
    assert fast_linear.counts() == {reason: 30}
    assert [r.getMessage() for r in caplog.records].count(
        f"hf_attn_patch: torch.bfloat16 Linear layers run torch's F.linear: {reason}"
    ) == 1
    assert out.dtype == torch.bfloat16


@pytest.mark.skipif(not BF16, reason="this CPU has no bf16 oneDNN kernels")
def test_bf16_runs_packed_where_the_cpu_has_it():
    model = small_llama(torch.bfloat16)
    with torch.no_grad():
        model(torch.randint(0, 300, (1, 6)))
    assert fast_linear.counts() == {fast_linear.PACKED: 15}


def test_a_deep_copy_packs_its_own_weights_and_unpatches():
    model = small_llama()
    ids = torch.randint(0, 300, (2, 7))
    with torch.no_grad():
        want = model(ids).logits  # the packed copies exist now: an opaque oneDNN tensor deepcopy cannot copy
    copy = deepcopy(model)
    assert fast_linear.installed(copy) == 15 and "_fast_packed" not in copy.lm_head.__dict__
    fast_linear.reset_counts()
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, want)  # the same packed product on the same weights
    assert fast_linear.counts() == {fast_linear.PACKED: 15}
    hf_attn_patch.unpatch()
    try:
        assert fast_linear.installed(copy) == 0
    finally:
        hf_attn_patch.patch()
    assert fast_linear.installed(copy) == 15


def test_unpatch_restore_and_install():
    model = small_llama()
    hf_attn_patch.unpatch()
    try:
        assert fast_linear.installed(model) == 0
        assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert "_fast_packed" not in model.lm_head.__dict__
    finally:
        hf_attn_patch.patch()
    assert fast_linear.installed(model) == 15
    assert fast_linear.restore(model) == 15 and fast_linear.installed(model) == 0
    hf_attn_patch.unpatch()
    hf_attn_patch.patch()
    assert fast_linear.installed(model) == 0  # restored by the user: stays plain
    assert fast_linear.install(model) == 15
    with hf_attn_patch.unpatched():
        stock = small_llama()
    assert fast_linear.installed(stock) == 0


def test_generate_and_speculative_verification_are_greedy_exact(stories):
    """stories260k, fp32: plain and speculative (n-gram lookup: multi-token verification forwards) generate() with
    the packed layers give the stock model's tokens, and the logits agree within STORIES_ATOL (conftest.py)."""
    model, tok = stories
    with hf_attn_patch.unpatched():
        stock = type(model)(model.config).eval()
    stock.load_state_dict(model.state_dict())
    assert fast_linear.installed(model) == linear_count(model) and fast_linear.installed(stock) == 0
    ids = tok(
        ["Once upon a time, there was a little girl who loved the sun. Once upon a time, there"], return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, atol=STORIES_ATOL, rtol=0)
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    reference = stock.generate(ids, **kw)
    fast_linear.reset_counts()
    assert torch.equal(model.generate(ids, **kw), reference)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=4, **kw), reference)
    assert set(fast_linear.counts()) <= set(fast_linear.FAST) and fast_linear.counts().get(fast_linear.PACKED)


def test_engine_runs_packed_and_is_greedy_exact(stories):
    model, tok = stories
    fast_linear.restore(model)  # a model without FastLinear: the engine installs it
    engine = Engine(model, tok, block_size=4, max_batch_tokens=64)
    assert fast_linear.installed(model) == linear_count(model)
    prompts = ["Once upon a time, there was a little girl", "The cat sat", "Tom and his dog went to the park."]
    fast_linear.reset_counts()
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert set(fast_linear.counts()) <= set(fast_linear.FAST) and fast_linear.counts().get(fast_linear.PACKED)
    fast_linear.set_enabled(False)
    for out in outs:
        ids = out.prompt_token_ids
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids) :].tolist()


@pytest.mark.skipif(not BF16, reason="this CPU has no bf16 oneDNN kernels")
def test_bf16_generate_is_greedy_exact(stories):
    """bf16: the packed product and F.linear both round an fp32 sum once; greedy tokens of the stock bf16 model."""
    model, tok = stories
    with hf_attn_patch.unpatched():
        stock = type(model)(model.config)
    stock.load_state_dict(model.state_dict())
    stock = stock.to(torch.bfloat16).eval()
    ours = AutoModelForCausalLM.from_config(model.config).eval()
    ours.load_state_dict(model.state_dict())
    ours = ours.to(torch.bfloat16)
    ids = tok(["Once upon a time, there was a little girl"], return_tensors="pt").input_ids
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    fast_linear.reset_counts()
    assert torch.equal(ours.generate(ids, **kw), stock.generate(ids, **kw))
    assert set(fast_linear.counts()) <= set(fast_linear.FAST) and fast_linear.counts().get(fast_linear.PACKED)
