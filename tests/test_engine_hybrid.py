"""Engine on hybrid models (constant-state layers): each request's greedy output equals generate() for that prompt
alone, with chunked prefill mixed into other requests' decodes and with preemption; state slots are never leaked;
what cannot work (speculative decoding, forks, rollback, unsupported mixers) is refused by name."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import transformers

import hf_attn_patch
from hf_attn_patch.attention.state_layers import STATE_MIXERS, mixer_classes
from hf_attn_patch.cache.manager import KVManager
from hf_attn_patch.cache.state_pool import StateSlots
from hf_attn_patch.engine import Engine, SamplingParams

from .conftest import _randomize_norms

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.3,
)  # 0.3: varied greedy tokens (at 0.02 these tiny models repeat one token)
CONFIGS = {
    # LFM2-1.2B: hidden 2048, 16 layers (10 short-conv, 6 attention), conv_L_cache 3
    "lfm2": dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),
    # LFM2-8B-A1B: 24 layers (18 short-conv, 6 attention), 32 experts, top 4, 2 dense layers
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=1),
    # Qwen3-Next-80B-A3B: 48 layers, 3 gated-delta-net : 1 attention, 16 / 32 linear heads of 128, conv kernel 4
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention", "linear_attention"], head_dim=8,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=16),
    # Qwen3.5 (text): the same 3 : 1 gated-delta-net / attention layout, dense MLP
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention", "linear_attention"], head_dim=8,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_conv_kernel_dim=3),
    # Olmo-Hybrid-7B: 32 layers, 3 gated-delta-net : 1 attention, conv kernel 4
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                        linear_value_head_dim=8, linear_conv_kernel_dim=3),
    # Bamba-9B: 32 layers (Mamba2, attention at 9, 18, 27), 128 Mamba heads of 64, d_state 128, d_conv 4
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8,
                  mamba_d_conv=3, mamba_expand=1, mamba_chunk_size=8),
    # Granite-4.0-H-Small: 40 layers (Mamba2, 4 attention), 72 experts, top 10, shared expert
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=8,
                             mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3, mamba_expand=1, mamba_chunk_size=8,
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16),
}  # fmt: skip
# Jamba-v0.1: 32 layers (Mamba1, attention every 8th at offset 4), 16 experts every 2nd layer: whole prefills only
JAMBA = dict(
    attn_layer_period=3,
    attn_layer_offset=1,
    expert_layer_period=3,
    expert_layer_offset=2,
    num_experts=2,
    mamba_d_state=8,
    mamba_d_conv=3,
    mamba_expand=1,
    mamba_dt_rank=4,
    use_mamba_kernels=False,
)
PROMPTS = [
    [5, 9, 13, 22, 40, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7, 8, 9, 30, 31],
    [3, 4, 5],
    [50, 60, 70, 80, 90, 11, 12],
    [7],
    [12, 14, 16, 18, 20, 22, 24, 26, 28],
]
MAX_TOKENS = 14


def hybrid_model(model_type: str, **overrides):
    torch.manual_seed(0)
    family = JAMBA if model_type == "jamba" else CONFIGS[model_type]
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **family, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize_norms(model)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return hf_attn_patch.models.pretrained.load_default()[1]


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request):
    """(model, greedy generate() continuation of each prompt alone, up to EOS or MAX_TOKENS)."""
    model = hybrid_model(request.param)
    reference = []
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        reference.append(out[0, len(prompt) :].tolist())
    return model, reference


def _run(model, tokenizer, **options):
    """Engine outputs for PROMPTS, with a record of each step's schedule [(request id, start, n, prompt length)]
    and the number of calls of the stock state-layer forwards."""
    engine = Engine(model, tokenizer, block_size=4, **options)
    steps = []
    forward = engine.runner.forward

    def recording(output, keep):  # what the runner reads: the SchedulerOutput, naming requests by id
        prompt_lengths = [len(engine.scheduler.requests[i].prompt_ids) for i in output.req_ids]
        steps.append(list(zip(output.req_ids, output.starts, output.num_tokens, prompt_lengths)))
        return forward(output, keep)

    engine.runner.forward = recording
    with counting_mixer_calls() as calls:
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return engine, outputs, steps, calls[0]


@contextlib.contextmanager
def counting_mixer_calls():
    """[calls of the stock mixer forwards] while the block runs: the patch is re-installed over counting stock
    forwards, so its per-sequence wrapper calls the counters; everything is put back after."""
    calls = [0]

    def counting(forward):
        @functools.wraps(forward)  # the wrapper reads the stock signature through __wrapped__
        def forward_counted(*args, **kwargs):
            calls[0] += 1
            return forward(*args, **kwargs)

        return forward_counted

    classes = mixer_classes()
    hf_attn_patch.unpatch()
    stock = {cls: vars(cls)["forward"] for cls in classes}
    for cls in classes:
        cls.forward = counting(stock[cls])
    hf_attn_patch.patch()
    try:
        yield calls
    finally:
        hf_attn_patch.unpatch()
        for cls in classes:
            cls.forward = stock[cls]
        hf_attn_patch.patch()


@pytest.mark.parametrize("options", [dict(max_batch_tokens=6, prefill_chunk=4),  # prefills split, mixed with decodes
                                     dict(max_batch_tokens=64, num_blocks=12)],  # too few blocks: preemption
                         ids=["chunked", "preempting"])  # fmt: skip
def test_greedy_equals_generate_alone(family, tokenizer, options):
    model, reference = family
    engine, outputs, steps, calls = _run(model, tokenizer, **options)
    for out, expected in zip(outputs, reference):
        assert out.token_ids == expected  # the full sequence: an engine that stops early (or runs on) fails
        assert out.finish_reason == ("stop" if expected[-1] == 2 else "length")
    if "prefill_chunk" in options:  # a prompt continued mid-way in a step that also decodes another request
        assert any(
            any(0 < start < length for _, start, _, length in step)
            and any(start >= length for _, start, _, length in step)
            for step in steps
        )
    else:
        assert engine.scheduler.preemptions > 0  # 11 usable blocks of 4 tokens cannot hold all five requests
    # each state layer ran once per sequence, except the one-token decodes of a step: once for all of them
    decodes = [sum(n == 1 and start > 0 for _, start, n, _ in step) for step in steps]
    assert max(decodes) > 1  # the batched decode path ran
    state_layers = sum(g == "state" for g in engine.runner.layer_groups)
    assert calls == state_layers * sum(len(step) - max(0, k - 1) for step, k in zip(steps, decodes))
    assert engine.kv.states.num_live() == 0 and engine.kv.states.num_free() == engine.kv.states.num_slots
    assert engine.kv.num_live_blocks() == 0


def test_without_the_per_sequence_wrapper_the_outputs_differ(tokenizer):
    """The check above can fail: the stock mixer forward over the packed row (no state, sequences mixed) gives
    other tokens."""
    model = hybrid_model("lfm2")
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    (mixer,) = [c for c in mixer_classes() if c.__name__ == STATE_MIXERS["lfm2"][1]]
    engine = Engine(model, tokenizer, block_size=4, max_batch_tokens=6, prefill_chunk=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mixer, "forward", mixer.forward.__wrapped__)  # after the engine checked the wrapper is there
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in outputs] != expected


def test_prefix_caching_is_off_and_slots_are_reused(family, tokenizer):
    model, reference = family
    engine = Engine(model, tokenizer, block_size=4, max_num_seqs=2, prefix_caching=True)
    assert not engine.kv.prefix_caching  # a state is not block-wise: no prefix hits
    for _ in range(2):
        outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        assert [o.token_ids for o in outputs] == reference  # a reused slot starts from an empty state
        assert all(o.prefix_hit_tokens == 0 for o in outputs)
    assert engine.kv.states.num_live() == 0


def test_abort_frees_the_state_slot(tokenizer):
    model = hybrid_model("qwen3_next")
    engine = Engine(model, tokenizer, block_size=4, max_batch_tokens=32)  # all three join the first step
    ids = [engine.add_request(p, SamplingParams(max_tokens=30, temperature=0)) for p in PROMPTS[:3]]
    engine.step()
    assert engine.kv.states.num_live() == 3
    engine.abort(ids[1])
    assert engine.kv.states.num_live() == 2 and ids[1] not in engine.kv.states.owner
    final = {out.request_id: out for out in engine.stream() if out.finished}
    assert final[ids[1]].finish_reason == "abort"
    assert engine.kv.states.num_live() == 0 and engine.kv.num_live_blocks() == 0


def test_speculative_decoding_is_refused_before_work(tokenizer):
    engine = Engine(hybrid_model("lfm2"), tokenizer, block_size=4)
    with pytest.raises(ValueError, match="num_speculative_tokens=2"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, num_speculative_tokens=2))
    assert not engine.has_unfinished() and not engine.scheduler.waiting


def test_unsupported_state_layers_are_refused_by_type(tokenizer, monkeypatch):
    model = hybrid_model("lfm2")
    monkeypatch.delitem(STATE_MIXERS, "lfm2")  # as for a family not in the table
    with pytest.raises(ValueError, match="layer 0 of 'lfm2' is a 'conv' layer, which the engine does not serve"):
        Engine(model, tokenizer, block_size=4)


def test_jamba_is_served_with_whole_prefills_only(tokenizer):
    """Mamba1's sequence scan ignores a previous state: chunked prefill is refused, whole prefills are exact."""
    model = hybrid_model("jamba")
    with pytest.raises(ValueError, match="chunked_prefill=True, but layer 0 \\(JambaMambaMixer\\)"):
        Engine(model, tokenizer, block_size=4)
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    engine, outputs, steps, _ = _run(model, tokenizer, max_batch_tokens=8, num_blocks=12, chunked_prefill=False)
    assert [o.token_ids for o in outputs] == expected
    assert engine.scheduler.preemptions > 0 and any(n > 8 for step in steps for _, _, n, _ in step)  # whole prompts
    assert engine.kv.states.num_live() == 0


def test_manager_refuses_fork_and_crop_of_states():
    kv = KVManager(4, 16, [None], state_slots=2)
    kv.add("a")
    kv.allocate("a", 0, 6)
    with pytest.raises(ValueError, match="fork"):
        kv.fork("a", "b")
    with pytest.raises(ValueError, match="crop"):
        kv.crop("a", 3)
    assert kv.state_slot("a") == 0 and "b" not in kv.sequences and kv.states.num_live() == 1
    kv.add("c")
    with pytest.raises(RuntimeError, match="all 2 slots are held"):
        kv.add("d")
    assert "d" not in kv.sequences
    kv.free("a")
    kv.add("e")
    assert kv.state_slot("e") == 0 and kv.state_slot("c") == 1  # the lowest free slot
    kv.free("e")
    kv.free("c")
    assert kv.states.num_live() == 0 and kv.num_live_blocks() == 0


def test_state_slots():
    slots = StateSlots(3)
    assert [slots.allocate(i) for i in "abc"] == [0, 1, 2]
    with pytest.raises(ValueError, match="already holds slot 1"):
        slots.allocate("b")
    slots.free("b")
    slots.free("b")  # idempotent
    assert slots.allocate("d") == 1 and slots.num_free() == 0
    with pytest.raises(ValueError, match="num_slots=0"):
        StateSlots(0)


def test_plain_forward_is_untouched_and_unpatch_restores_the_mixers(tokenizer):
    model = hybrid_model("qwen3_next")
    prompt = torch.tensor([PROMPTS[0]])
    patched = model.generate(prompt, max_new_tokens=8, do_sample=False)
    wrapped = {cls: vars(cls)["forward"] for cls in mixer_classes()}
    assert all(getattr(f, "runs_per_sequence", False) for f in wrapped.values())
    with hf_attn_patch.unpatched():
        assert all(vars(cls)["forward"] is f.__wrapped__ for cls, f in wrapped.items())
        with pytest.raises(RuntimeError, match="unpatched"):
            Engine(model, tokenizer, block_size=4)
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), patched)
    rewrapped = {cls: vars(cls)["forward"] for cls in mixer_classes()}  # patch() again: a new wrapper each
    assert all(f.runs_per_sequence and f.__wrapped__ is wrapped[cls].__wrapped__ for cls, f in rewrapped.items())


def test_max_memory_holds_the_states_and_the_blocks(tokenizer):
    model = hybrid_model("qwen3_next")
    state = hf_attn_patch.kv_cache_bytes(model.config, 0, dtype=torch.float32)  # conv + recurrent, per sequence
    block = hf_attn_patch.kv_cache_bytes(model.config, 4, dtype=torch.float32) - state
    assert state > 0 and block > 0
    engine = Engine(model, tokenizer, block_size=4, max_num_seqs=3, max_memory=3 * state + 10 * block + block - 1)
    assert engine.kv.num_blocks == 10 and engine.kv.states.num_slots == 3
    with pytest.raises(ValueError, match="max_num_seqs=3"):
        Engine(model, tokenizer, block_size=4, max_num_seqs=3, max_memory=3 * state + block)


@pytest.mark.parametrize("seed", range(5))
def test_state_slots_follow_the_sequences_under_random_operations(seed):
    """Random add / allocate / free / preempt-and-readd: every live sequence holds exactly one slot of its own,
    nothing else holds one, and nothing is left when all are freed."""
    rng = torch.Generator().manual_seed(seed)
    kv, names = KVManager(4, 64, [None, 3], state_slots=4), iter(range(10**6))
    for _ in range(300):
        op = int(torch.randint(0, 3, (1,), generator=rng))
        live = list(kv.sequences)
        if op == 0 and kv.states.num_free():
            seq = next(names)
            kv.add(seq)
            if kv.can_allocate(seq, 0, 5):
                kv.allocate(seq, 0, 5)
        elif op == 1 and live:
            kv.free(live[int(torch.randint(0, len(live), (1,), generator=rng))])
        elif op == 2 and live:  # preemption: freed, then the same id comes back with a fresh slot
            seq = live[0]
            kv.free(seq)
            kv.add(seq)
        slots = kv.states.owner
        assert set(slots) == set(kv.sequences) and len(set(slots.values())) == len(slots)
        assert kv.states.num_free() + kv.states.num_live() == 4 and all(0 <= s < 4 for s in slots.values())
    for seq in list(kv.sequences):
        kv.free(seq)
    assert kv.states.num_live() == 0 and kv.num_live_blocks() == 0
