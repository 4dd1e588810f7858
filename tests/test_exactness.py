"""Our modules with the stock weights reproduce transformers' own modules (fp32, atol 1e-5), per architecture.

Each test also checks that our module is what ran (type of the layer and a forward-call counter), so a test cannot
pass by silently running the stock code.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_attn_patch.attention import GroupedQueryAttention, MultiHeadLatentAttention
from hf_attn_patch.compat import cache_kwarg
from hf_attn_patch.converters.targets.exact import to_variant

from .conftest import TINY_ATOL, tiny_model

ATOL = TINY_ATOL  # fp32; the MLA lift reorders sums (scale folded into W_q, latent matmuls), measured error ~1e-7

CASES = [
    ("llama", "gqa"), ("llama", "mla"),
    ("mistral", "gqa"), ("mistral", "mla"),
    ("qwen2", "gqa"), ("qwen2", "mla"),
    ("qwen3", "gqa"),  # q/k RMSNorm sits between W_k and RoPE: no exact MLA form exists (lossy: converter issue)
    ("gpt2", "gqa"), ("gpt2", "mla"),
    ("gpt_neox", "gqa"), ("gpt_neox", "mla"),
    ("opt", "gqa"), ("opt", "mla"),
]  # fmt: skip


def ours(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (GroupedQueryAttention, MultiHeadLatentAttention))]


class CallCounter:
    """Counts forward calls of our attention modules: proof that the patched path ran."""

    def __init__(self, model):
        self.calls = 0
        self.handles = [m.register_forward_hook(self._hook) for m in ours(model)]
        assert self.handles, "the converted model has none of our attention modules"

    def _hook(self, *args):
        self.calls += 1


def stepwise_logits(model, ids, mask, steps: int) -> torch.Tensor:
    """Prefill all but the last `steps` tokens, then decode them one by one through a DynamicCache."""
    cache = DynamicCache(config=model.config)
    prefix = ids.shape[1] - steps
    outs = [model(ids[:, :prefix], attention_mask=mask[:, :prefix], **cache_kwarg(cache)).logits[:, -1]]
    for t in range(prefix, ids.shape[1]):
        outs.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **cache_kwarg(cache)).logits[:, -1])
    return torch.stack(outs, 1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type,variant", CASES)
def test_variant_reproduces_stock(model_type, variant, attn, padded_batch):
    ids, mask = padded_batch
    stock = tiny_model(model_type, attn)
    model = to_variant(stock, variant)
    assert model.config.attention_variant == variant
    counter = CallCounter(model)
    keep = mask.bool()
    with torch.no_grad():
        ref, got = stock(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[keep], ref[keep], atol=ATOL, rtol=0)
        ref_steps, got_steps = stepwise_logits(stock, ids, mask, 4), stepwise_logits(model, ids, mask, 4)
        torch.testing.assert_close(got_steps, ref_steps, atol=ATOL, rtol=0)
    assert counter.calls == len(ours(model)) * 6  # 1 full forward + 1 prefill + 4 decode steps, every layer


@pytest.mark.parametrize("model_type,variant", CASES)
def test_greedy_generate_token_identical(model_type, variant, padded_batch):
    ids, mask = padded_batch
    stock = tiny_model(model_type)
    model = to_variant(stock, variant)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    counter = CallCounter(model)
    assert torch.equal(model.generate(ids, **kw), stock.generate(ids, **kw))
    assert counter.calls > 0


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "opt"])
def test_mla_naive_and_absorbed_agree(model_type, padded_batch):
    ids, mask = padded_batch
    model = to_variant(tiny_model(model_type), "mla")
    layers = ours(model)
    results = {}
    for mode in ("never", "always"):
        for layer in layers:
            layer.absorb = mode
        with torch.no_grad():
            results[mode] = (model(ids, attention_mask=mask).logits, stepwise_logits(model, ids, mask, 4))
    keep = mask.bool()
    torch.testing.assert_close(results["always"][0][keep], results["never"][0][keep], atol=ATOL, rtol=0)
    torch.testing.assert_close(results["always"][1], results["never"][1], atol=ATOL, rtol=0)


def test_auto_absorb_picks_by_flops():
    layer = ours(to_variant(tiny_model("llama"), "mla"))[0]
    d_c, d_n, d_v = layer.kv_lora_rank, layer.qk_nope_head_dim, layer.v_head_dim
    assert layer.use_absorbed(1)  # decode: one query per row
    threshold = d_c * (d_n + d_v) / (2 * d_c - d_n - d_v)
    assert not layer.use_absorbed(int(threshold) + 1)  # long prefill: expanding K/V is cheaper
    layer.absorb = "bogus"
    with pytest.raises(ValueError, match="absorb='bogus'"):
        layer(torch.zeros(1, 2, layer.spec.hidden_size), position_embeddings=None)


@pytest.mark.parametrize("model_type,variant", [("llama", "gqa"), ("gpt2", "gqa"), ("llama", "mla"), ("opt", "mla")])
def test_cache_holds_only_what_the_variant_needs(model_type, variant, padded_batch):
    ids, mask = padded_batch
    model = to_variant(tiny_model(model_type), variant)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, **cache_kwarg(cache))
    layer = cache.layers[0]
    layer_module = ours(model)[0]
    if variant == "gqa":
        kv_heads = layer_module.spec.num_key_value_heads
        assert layer.keys.shape == (2, kv_heads, ids.shape[1], layer_module.head_dim)
        assert layer.values.shape == layer.keys.shape
    else:  # the latent and the shared RoPE key only: d_c + d_r values per token
        assert layer.keys.shape == (2, 1, ids.shape[1], layer_module.kv_lora_rank)
        assert layer.values.shape == (2, 1, ids.shape[1], layer_module.qk_rope_head_dim)


@pytest.mark.parametrize("model_type,variant", [("llama", "mla"), ("gpt2", "gqa"), ("gpt_neox", "mla")])
def test_saved_variant_loads_with_auto_class(model_type, variant, tmp_path, padded_batch):
    """config.json selects the variant; AutoModelForCausalLM loads it with no trust_remote_code."""
    ids, mask = padded_batch
    model = to_variant(tiny_model(model_type), variant)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(ours(loaded)[0]) is type(ours(model)[0])
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_source_model_not_modified():
    stock = tiny_model("llama")
    before = {k: v.clone() for k, v in stock.state_dict().items()}
    to_variant(stock, "mla")
    assert not ours(stock)
    assert all(torch.equal(before[k], v) for k, v in stock.state_dict().items())


def _replicate_kv_heads(weight: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[H*d, ...] K or V rows -> (rows with every head replaced by its group's first head, the H_kv group heads)."""
    per_head = weight.view(heads, -1, *weight.shape[1:])
    group_heads = per_head[:: heads // kv_heads]
    return group_heads.repeat_interleave(heads // kv_heads, dim=0).reshape(weight.shape), group_heads.reshape(
        -1, *weight.shape[1:]
    )


@pytest.mark.parametrize("kv_heads", [1, 2, 3])  # MQA, GQA, GQA; 6 (MHA) is covered above
@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_fewer_kv_heads_match_stock_mha_with_replicated_heads(model_type, kv_heads, padded_batch):
    """An MHA model whose K/V heads are equal within groups *is* a GQA model: ours with H_kv heads must match it."""
    ids, mask = padded_batch
    stock = tiny_model(model_type)
    heads = stock.config.num_attention_heads
    grouped = {}
    with torch.no_grad():
        for name, module in stock.named_modules():
            if model_type == "gpt2" and name.endswith(".attn"):
                d = stock.config.hidden_size
                weight, bias = module.c_attn.weight, module.c_attn.bias  # Conv1D [in, q|k|v]
                k_w, k_g = _replicate_kv_heads(weight[:, d : 2 * d].t().contiguous(), heads, kv_heads)
                v_w, v_g = _replicate_kv_heads(weight[:, 2 * d :].t().contiguous(), heads, kv_heads)
                k_b, k_bg = _replicate_kv_heads(bias[d : 2 * d].clone(), heads, kv_heads)
                v_b, v_bg = _replicate_kv_heads(bias[2 * d :].clone(), heads, kv_heads)
                weight[:, d : 2 * d], weight[:, 2 * d :], bias[d : 2 * d], bias[2 * d :] = k_w.t(), v_w.t(), k_b, v_b
                grouped[name] = {"k_proj.weight": k_g, "v_proj.weight": v_g, "k_proj.bias": k_bg, "v_proj.bias": v_bg}
            elif model_type == "opt" and name.endswith(".self_attn"):
                grouped[name] = {}
                for proj in ("k_proj", "v_proj"):
                    for p in ("weight", "bias"):
                        full, group = _replicate_kv_heads(getattr(getattr(module, proj), p).clone(), heads, kv_heads)
                        getattr(getattr(module, proj), p).copy_(full)
                        grouped[name][f"{proj}.{p}"] = group
    reference = to_variant(stock, "gqa")  # H_kv = H, proven equal to stock above
    config = reference.config
    config.num_key_value_heads = kv_heads
    model = type(reference)(config).eval()
    state = reference.state_dict()
    state.update({f"{n}.{k}": v for n, sd in grouped.items() for k, v in sd.items()})
    model.load_state_dict(state)
    assert ours(model)[0].k_proj.out_features == kv_heads * ours(model)[0].head_dim
    keep = mask.bool()
    with torch.no_grad():
        ref = stock(ids, attention_mask=mask).logits
        torch.testing.assert_close(model(ids, attention_mask=mask).logits[keep], ref[keep], atol=ATOL, rtol=0)
        torch.testing.assert_close(
            stepwise_logits(model, ids, mask, 3), stepwise_logits(stock, ids, mask, 3), atol=ATOL, rtol=0
        )


def test_mla_gradients_agree_between_paths(padded_batch):
    """Healing (distillation) trains through these modules: both paths must give the same gradients."""
    ids, mask = padded_batch
    model = to_variant(tiny_model("llama"), "mla").train()
    # Padded positions attend to nothing, so their outputs are arbitrary: no loss may read them, neither as a
    # target nor as the position predicting the next target (the loss shifts labels by one).
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    grads = {}
    for mode in ("never", "always"):
        model.zero_grad()
        for layer in ours(model):
            layer.absorb = mode
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if "kv_b_proj" in n or "q_proj" in n}
    assert grads["never"] and all(g.abs().sum() > 0 for g in grads["never"].values())
    for name, grad in grads["never"].items():
        # the backward runs through the same reordered sums as the forward: small gradients carry the forward's
        # TINY_ATOL rounding; large ones a relative eps 1.2e-7 x 64-term reductions x 3 passes x 4 layers ~ 1e-4
        torch.testing.assert_close(grads["always"][name], grad, atol=1e-5, rtol=1e-4)
