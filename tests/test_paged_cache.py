"""PagedKVCache in generate(): token-identical to DynamicCache, and the memory behaviour it promises."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_attn_patch import CacheFullError, PagedKVCache
from hf_attn_patch.cache.paged_cache import PagedLayer
from hf_attn_patch.compat import cache_kwarg
from hf_attn_patch.converters.targets.exact import to_variant
from hf_attn_patch.models import load_default

from .conftest import tiny_model
from .test_kv_memory import HYBRIDS


class UpdateCounter:
    """Counts PagedLayer.update calls: proof the paged path ran (and not a DynamicCache made behind our back)."""

    def __init__(self, cache: PagedKVCache):
        self.calls = 0
        for layer in cache.paged:
            original = layer.update

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            layer.update = counted


def ragged(vocab: int = 97, lengths=(9, 4, 13), seed: int = 0):
    """Left-padded batch of prompts with the given lengths."""
    torch.manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width))
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, width - n :] = 1
    return ids.masked_fill(mask == 0, 0), mask


def no_room_for_runs(mask, max_new_tokens: int, block_size: int = 4) -> dict:
    """PagedKVCache options for a pool with room for every row's blocks but not for side-by-side runs: the rows
    are not laid out, so their reads gather whole pages or slots (left-padded rows only: unpadded ones need the
    runs' blocks themselves)."""
    total = mask.shape[1] + max_new_tokens
    need = sum(-(-(total - pad) // block_size) for pad in (mask.cumsum(1) == 0).sum(1).tolist())
    assert need < mask.shape[0] * -(-total // block_size), "rows without padding need the runs themselves"
    return {"num_blocks": need + 1}


def generate_both(model, ids, mask, block_size=4, cache_kwargs=None, **kw):
    kw = dict(attention_mask=mask, pad_token_id=0, **kw)
    reference = model.generate(ids, **kw)
    cache = PagedKVCache(model.config, block_size=block_size, **(cache_kwargs or {}))
    counter = UpdateCounter(cache)
    paged = model.generate(ids, cache=cache, **kw)
    assert counter.calls > 0
    return reference, paged, cache


MODELS = [
    ("llama", None), ("qwen2", None), ("gpt2", None), ("gpt_neox", None), ("opt", None), ("deepseek_v3", None),
    ("deepseek_v2", None),
    ("llama", "mla"), ("gpt2", "mla"), ("mistral", None),
]  # fmt: skip


@pytest.mark.parametrize("laid_out", [True, False])
@pytest.mark.parametrize("model_type,variant", MODELS)
def test_greedy_token_identical(model_type, variant, laid_out):
    """Both read paths: rows laid out side by side (strided views; generate()'s default when the pool has room)
    and rows gathered from a pool with no room for the runs."""
    model = tiny_model(model_type)
    model = to_variant(model, variant) if variant else model
    ids, mask = ragged()
    options = None if laid_out else no_room_for_runs(mask, 14)
    reference, paged, cache = generate_both(model, ids, mask, cache_kwargs=options, max_new_tokens=14, do_sample=False)
    assert torch.equal(reference, paged)
    if cache.groups == [None]:  # (a window group's layout lasts until its first freed block)
        assert (cache.slots.strided[None] is not None) == laid_out
    stats = cache.stats()
    assert 0 < stats["used_bytes"] <= stats["allocated_bytes"]


def test_cache_implementation_name_and_sampling():
    model = tiny_model("llama")
    ids, mask = ragged()
    kw = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=12, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(7)
    reference = model.generate(ids, **kw)
    torch.manual_seed(7)
    assert torch.equal(model.generate(ids, cache_implementation="paged_kv", **kw), reference)


def test_beam_search_same_beams_and_scores():
    model = tiny_model("llama")
    ids, mask = ragged()
    kw = dict(
        num_beams=3,
        num_return_sequences=2,
        max_new_tokens=10,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    reference, paged, cache = generate_both(model, ids, mask, **kw)
    assert torch.equal(reference.sequences, paged.sequences)
    # beam scores sum 10 log-probs of size <= 10 each computed in fp32 from the same K/V read another way
    # (gather vs concat: the same values, the same sums): eps 1.2e-7 x 10 steps x |score| <= 10 ~ 1e-5
    torch.testing.assert_close(paged.sequences_scores, reference.sequences_scores, atol=1e-5, rtol=0)


def test_forked_rows_share_prompt_blocks():
    """num_return_sequences copies each prompt before prefill; equal prompt blocks are stored once."""
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(16, 16))
    cache = PagedKVCache(model.config, block_size=4)
    torch.manual_seed(0)
    model.generate(
        ids, attention_mask=mask, cache=cache, do_sample=True, num_return_sequences=4, max_new_tokens=3, pad_token_id=0
    )
    prompt_blocks = 16 // 4
    # 8 rows; each holds 4 prompt blocks (shared by its 4 forks) and 1 private block for the 3 new tokens
    assert cache.stats()["blocks_used"] == 2 * prompt_blocks + 8


@pytest.mark.parametrize("laid_out", [True, False])
def test_padding_takes_no_memory(laid_out):
    """Whole blocks of left padding take no memory; a laid-out row also stores the padding inside its first block
    (fewer than block_size positions), so that its positions start at a block of its run."""
    model = tiny_model("llama")
    lengths = (3, 17, 9)
    ids, mask = ragged(lengths=lengths)
    options = {} if laid_out else no_room_for_runs(mask, 1)
    cache = PagedKVCache(model.config, block_size=4, **options)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)
    stored = [n + (17 - n) % 4 if laid_out else n for n in lengths]  # width 17: pads 14, 0, 8
    assert cache.stats()["blocks_used"] == sum(-(-n // 4) for n in stored) == (10 if laid_out else 9)
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, **cache_kwarg(dynamic))
    per_token = sum(layer.keys[0, :, 0].numel() * 2 * 4 for layer in dynamic.layers)  # K and V, fp32
    assert cache.stats()["used_bytes"] == sum(stored) * per_token
    assert (cache.slots.strided[None] is not None) == laid_out


def test_prefix_cache_hits_across_generate_calls():
    model, tokenizer = load_default()
    system = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
    prompts = [system + "One day", system + "She saw a big dog"]
    cache = PagedKVCache(model.config, block_size=8)
    kw = dict(max_new_tokens=12, do_sample=False)
    cold = [model.generate(**tokenizer(p, return_tensors="pt"), **kw) for p in prompts]
    outs = []
    for p in prompts:
        before = cache.stats()["prefix_hit_tokens"]
        outs.append(model.generate(**tokenizer(p, return_tensors="pt"), cache=cache, **kw))
        hits = cache.stats()["prefix_hit_tokens"] - before
    system_tokens = len(tokenizer(system).input_ids)
    assert hits >= (system_tokens // 8 - 1) * 8 > 0  # the second prompt reused the system prompt's full blocks
    assert all(torch.equal(a, b) for a, b in zip(cold, outs))  # a hit and a miss give the same tokens


def test_cache_full_error_names_the_numbers_and_changes_nothing():
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(13, 13))
    cache = PagedKVCache(model.config, block_size=4, num_blocks=8)  # 7 usable blocks, 8 needed for the prompts
    with pytest.raises(CacheFullError, match="8 blocks requested, 7 free or evictable of 7"):
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, pad_token_id=0)
    assert cache.stats()["blocks_used"] == 0


@pytest.mark.parametrize("lengths", [(6, 6), (6,)])  # gathered rows, and one row read as a storage view
def test_sliding_window_frees_blocks_and_matches(lengths):
    model = tiny_model("mistral")  # sliding_window 5
    ids, mask = ragged(lengths=lengths)
    reference, paged, cache = generate_both(model, ids, mask, max_new_tokens=30, do_sample=False)
    assert torch.equal(reference, paged)
    # 36 tokens per row, but only the window (5) plus a partly filled block stays allocated (freed blocks are reused)
    assert cache.stats()["blocks_used"] <= len(lengths) * (-(-5 // 4) + 1)


@pytest.mark.parametrize("config_class", ["Qwen3NextConfig", "BambaConfig"])
def test_hybrid_models_pass_their_states_through(config_class):
    config = getattr(transformers, config_class)(vocab_size=97, **HYBRIDS[config_class])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, mask = ragged(lengths=(7, 7))
    reference, paged, cache = generate_both(model, ids, mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(reference, paged)
    assert not cache.prefix_caching and any(not isinstance(layer, PagedLayer) for layer in cache.layers)
    other = ragged(lengths=(5,), seed=3)  # the same cache object, a new request: states start over
    kw = dict(attention_mask=other[1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(other[0], cache=cache, **kw), model.generate(other[0], **kw))


def test_assisted_decoding_crops_the_cache():
    model = tiny_model("llama")
    assistant = tiny_model("llama", seed=5)
    ids = torch.randint(3, 97, (1, 8))
    kw = dict(max_new_tokens=15, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kw)
    cache = PagedKVCache(model.config, block_size=4)
    counter = UpdateCounter(cache)
    out = model.generate(ids, assistant_model=assistant, cache=cache, **kw)
    assert torch.equal(out, reference) and counter.calls > 0
    used = cache.stats()
    assert used["blocks_used"] == -(-(out.shape[1] - 1) // 4)  # rejected draft tokens were cropped away


def test_growable_pool_and_bad_arguments():
    model = tiny_model("llama")
    ids, mask = ragged(lengths=(40,) * 4)
    reference, paged, cache = generate_both(model, ids, mask, block_size=2, max_new_tokens=40, do_sample=False)
    assert torch.equal(reference, paged) and cache.stats()["blocks_total"] > 64  # the pool doubled on demand
    with pytest.raises(ValueError, match="block_size=0"):
        PagedKVCache(model.config, block_size=0)
    with pytest.raises(ValueError, match="not both"):
        PagedKVCache(model.config, num_blocks=8, max_memory=1 << 20)
    with pytest.raises(ValueError, match="max_memory=10 gives 0 block"):
        c = PagedKVCache(model.config, max_memory=10)
        model(ids[:1], **cache_kwarg(c))


def test_max_memory_sizes_the_pool():
    model = tiny_model("llama")  # 2 layers, 2 KV heads, head_dim 8: 64 values per token
    cache = PagedKVCache(model.config, block_size=4, max_memory=64 * 4 * 4 * 10)  # 10 blocks of fp32
    with torch.no_grad():
        model(torch.randint(3, 97, (1, 5)), **cache_kwarg(cache))
    assert cache.stats()["blocks_total"] == 9  # 10 blocks, one is the null block


@pytest.mark.smollm2
def test_smollm2_greedy_identical():
    from hf_attn_patch.models import load_smollm2

    model, tokenizer = load_smollm2()
    tokenizer.padding_side = "left"
    enc = tokenizer(["The capital of France is", "List three colors:"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(model.generate(**enc, **kw), model.generate(**enc, cache_implementation="paged_kv", **kw))


@pytest.mark.parametrize("model_type,variant", [("llama", None), ("gpt2", "gqa"), ("llama", "mla")])
@pytest.mark.parametrize("batch_lengths", [(9, 4, 13), (11,)])  # gather path, and the one-row contiguous view
def test_registered_paged_attention_reads_blocks_itself(model_type, variant, batch_lengths, monkeypatch):
    """attn_implementation="paged_kv" with the kernel gate open (as on CUDA): every decode step hands attention the
    pages and the step's metadata, the decode kernel reads them by block table (block_size 4, left padding not
    stored), and tokens match sdpa with DynamicCache; no forward context outlives the forward."""
    import hf_attn_patch.kernels.ops as kernels
    from hf_attn_patch.cache import metadata

    model = tiny_model(model_type)
    model = to_variant(model, variant) if variant else model
    ids, mask = ragged(lengths=batch_lengths)
    kw = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=10, do_sample=False)
    reference = model.generate(ids, **kw)
    name = "mla_decode" if variant == "mla" else "paged_decode_attention"
    original, calls = getattr(kernels, name), []

    def spy(*args, **kwargs):
        calls.append((kwargs["block_size"], args[4].tolist()))  # block size, context lengths [B]
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, name, spy)
    monkeypatch.setattr(metadata, "use_kernels", lambda query: True)
    model.set_attn_implementation("paged_kv")
    out = model.generate(ids, cache=PagedKVCache(model.config, block_size=4), **kw)
    model.set_attn_implementation("sdpa")
    assert torch.equal(out, reference)
    assert len(calls) == 9 * model.config.num_hidden_layers  # every decode step after the prefill, every layer
    assert all(size == 4 for size, _ in calls)
    assert calls[0][1] == [n + 1 for n in batch_lengths]  # stored lengths: each row's own, padding excluded
    assert metadata.get_forward_context() is None


def test_masked_hole_takes_the_reference_not_the_kernels(monkeypatch):
    """A prompt mask with a hole after the first real token is not left padding: the block-table kernels (which see
    every stored position as visible) must not run, and tokens still match sdpa with DynamicCache."""
    import hf_attn_patch.kernels.ops as kernels
    from hf_attn_patch.cache import metadata

    model = tiny_model("llama")
    ids, mask = ragged(lengths=(9, 6))
    mask[0, 3] = 0  # row 0: a hole inside its prompt
    kw = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=6, do_sample=False)
    reference = model.generate(ids, **kw)
    calls = []
    monkeypatch.setattr(kernels, "paged_decode_attention", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(metadata, "use_kernels", lambda query: True)
    model.set_attn_implementation("paged_kv")
    out = model.generate(ids, cache=PagedKVCache(model.config, block_size=4), **kw)
    model.set_attn_implementation("sdpa")
    assert torch.equal(out, reference)
    assert calls == []


@pytest.mark.parametrize("lengths,laid_out", [((9, 4, 13), False), ((9, 4, 13), True), ((7,), True)])
def test_steady_decode_steps_reuse_the_slots_and_match(lengths, laid_out, monkeypatch):
    """A decode step inside the rows' current blocks skips the allocation and slot rebuilding (each write slot is
    the last one + 1); a step that starts a block plans again. Output stays token-identical to DynamicCache.
    Gathered rows, rows laid out side by side (their stored positions start at their padding's block boundary),
    and one row read as a storage view."""
    model = tiny_model("llama")
    ids, mask = ragged(lengths=lengths)
    planned = []
    original = PagedKVCache._plan_step
    monkeypatch.setattr(
        PagedKVCache,
        "_plan_step",
        lambda self, start, new, device: (planned.append(start), original(self, start, new, device))[1],
    )
    options = None if laid_out else no_room_for_runs(mask, 24)
    reference, paged, cache = generate_both(
        model, ids, mask, block_size=4, cache_kwargs=options, max_new_tokens=24, do_sample=False
    )
    assert torch.equal(reference, paged)
    assert (cache.slots.strided[None] is not None) == laid_out
    width, pads = ids.shape[1], [ids.shape[1] - n - (ids.shape[1] - n) % 4 * laid_out for n in lengths]
    decodes = range(width, width + 23)  # positions written by the 23 decode steps
    # planned: the prefill (0), the first decode step, and every step where some row's stored position starts a block
    expected = [0, width] + [p for p in decodes[1:] if any((p - pad) % 4 == 0 for pad in pads)]
    assert planned == expected
