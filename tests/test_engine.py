"""Engine: every request's greedy output equals plain generate() for that prompt alone, whatever the batching."""

from __future__ import annotations

import pytest
import torch

from hf_attn_patch.engine import Engine, SamplingParams

from .conftest import tiny_model

MLA = dict(attention_variant="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine.",
    "The cat sat",
    "Tom and his dog went to the park. Tom and his dog",
    "Once upon a time, there was a little girl named Lily. She loved",
]


def _reference(model, prompt_ids: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize(
    "options",
    [dict(max_batch_tokens=32, prefill_chunk=8), dict(max_batch_tokens=64, chunked_prefill=False),
     dict(max_batch_tokens=64, num_blocks=40), dict(max_batch_tokens=512, max_num_seqs=2)],
    ids=["chunked", "whole-prefill", "preempting", "two-at-a-time"],
)  # fmt: skip
def test_greedy_equals_generate_alone(stories, options):
    model, tok = stories
    engine = Engine(model, tok, block_size=4, **options)
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0))
    for out in outputs:
        assert out.token_ids == _reference(model, out.prompt_token_ids, 40)  # full length: stopping early fails
        assert out.finish_reason in ("length", "stop")
    if "num_blocks" in options:
        assert engine.scheduler.preemptions > 0  # 39 blocks of 4 tokens cannot hold all four requests
    assert engine.kv.num_live_blocks() == 0  # finished requests freed every block


def test_kv_storage_is_made_at_construction_and_the_null_block_is_zero(stories):
    """The pool is allocated (zeroed) when the engine is built, not during the first request's forward; the
    warm-up token written into the null block is wiped."""
    model, tok = stories
    engine = Engine(model, tok, block_size=4, num_blocks=64)
    storage = engine.runner.storage
    assert len(storage) == model.config.num_hidden_layers and all(s is not None and s.num_blocks == 64 for s in storage)
    assert all(not s.any() for s in storage)  # every block, the null block included, holds zeros
    out = engine.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.token_ids == _reference(model, out.prompt_token_ids, 8)
    assert all(s.block_is_zero(0) for s in engine.runner.storage)  # nothing is ever written into the null block


def test_prefix_cache_reuses_a_shared_prompt(stories):
    model, tok = stories
    engine = Engine(model, tok, block_size=4)
    first = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0))[0]
    again = engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0))[0]
    assert first.prefix_hit_tokens == 0 and again.prefix_hit_tokens >= 16
    assert again.token_ids == first.token_ids == _reference(model, first.prompt_token_ids, 20)[:20]


@pytest.mark.parametrize(
    "model_type, overrides",
    [("gpt2", {}), ("opt", {}), ("gpt_neox", {}), ("qwen3", {}), ("llama", MLA), ("deepseek_v3", {})],
    ids=["gpt2", "opt", "gpt_neox", "qwen3", "llama-mla", "deepseek_v3"],
)
def test_architectures(model_type, overrides, stories):
    model = tiny_model(model_type, **overrides)
    engine = Engine(model, stories[1], block_size=4, max_batch_tokens=16)
    prompts = [[5, 9, 13, 22, 40, 7, 8, 9, 10, 11], [3, 4, 5], [50, 60, 70, 80, 90, 11, 12]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == _reference(model, prompt, 12)


def test_requests_join_and_leave_between_steps(stories):
    model, tok = stories
    engine = Engine(model, tok, block_size=4, max_batch_tokens=24)
    first = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0))
    for _ in range(5):
        engine.step()
    second = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0))
    doomed = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0))
    engine.step()
    engine.abort(doomed)
    final = {}
    for out in engine.stream():
        final[out.request_id] = out
    assert final[doomed].finish_reason == "abort"
    for rid, prompt, n in ((first, PROMPTS[0], 30), (second, PROMPTS[2], 10)):
        assert final[rid].token_ids == _reference(model, tok(prompt).input_ids, n)[:n]


def test_sampling_is_seeded_and_stops_apply(stories):
    model, tok = stories
    engine = Engine(model, tok)
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=7, logprobs=0)
    a, b = engine.generate([PROMPTS[1], PROMPTS[1]], [params, params])
    assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
    assert [lp.token_id for lp in a.logprobs] == a.token_ids and all(lp.logprob <= 0 for lp in a.logprobs)
    stopped = engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, stop=["."]))[0]
    assert stopped.finish_reason == "stop" and "." not in stopped.text


def test_bad_input_is_refused_before_work(stories):
    model, tok = stories
    with pytest.raises(ValueError, match="SamplingParams.temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_batch_tokens=0"):
        Engine(model, tok, max_batch_tokens=0)
    engine = Engine(model, tok, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="needs 26 blocks; the engine has 7"):
        engine.add_request([1] * 4, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="prompt: expected a non-empty"):
        engine.add_request([], SamplingParams())
    assert not engine.has_unfinished()


def test_speculative_ngram_steps_are_identical_and_fewer(stories):
    model, tok = stories
    prompts = [
        'The little bird said, "I want to fly!" The little bird',
        "Tom and Sue went to the park. They played on the swings. They played on the slide.",
    ]
    plain = Engine(model, tok, block_size=4)
    reference = plain.generate(prompts, SamplingParams(max_tokens=60, temperature=0))
    fast = Engine(model, tok, block_size=4, max_batch_tokens=64)
    outputs = fast.generate(prompts, SamplingParams(max_tokens=60, temperature=0, num_speculative_tokens=5))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert sum(o.metrics["speculative_accepted"] for o in outputs) > 0
    assert fast.steps < plain.steps


def test_per_request_grammar(stories):
    import json

    import jsonschema

    model, tok = stories
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name"],
        "properties": {"name": {"type": "string", "maxLength": 10}},
    }
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    engine = Engine(model, tok, block_size=4)
    json_out, regex_out, free = engine.generate(
        PROMPTS[:3],
        [
            SamplingParams(max_tokens=40, temperature=0, response_format=fmt),
            SamplingParams(
                max_tokens=40, temperature=0.8, seed=3, grammar={"type": "regex", "pattern": "(yes|no), [a-z]{3,6}"}
            ),
            SamplingParams(max_tokens=10, temperature=0),
        ],
    )
    jsonschema.validate(json.loads(json_out.text), schema)
    assert json_out.finish_reason == "stop"
    import re

    assert re.fullmatch("(yes|no), [a-z]{3,6}", regex_out.text)
    reference = model.generate(
        **tok(PROMPTS[0], return_tensors="pt"), max_new_tokens=40, do_sample=False, response_format=fmt, tokenizer=tok
    )
    assert tok.decode(reference[0, len(json_out.prompt_token_ids) :], skip_special_tokens=True) == json_out.text
    with pytest.raises(ValueError, match="response_format"):
        engine.add_request("Hi", SamplingParams(response_format={"type": "nope"}))


@pytest.mark.parametrize(
    "model_type, overrides",
    [("mistral", dict(sliding_window=5)),
     ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1, num_hidden_layers=3))],
    ids=["mistral-window", "qwen2-hybrid-window"],
)  # fmt: skip
def test_sliding_window_models(model_type, overrides, stories):
    """Windowed layers free the blocks no query sees again, and the output is still generate()'s."""
    model = tiny_model(model_type, **overrides)
    window = overrides["sliding_window"]
    engine = Engine(model, stories[1], block_size=2, max_batch_tokens=8)
    prompts = [[5, 9, 13, 22, 40, 7, 8, 9, 10, 11, 3, 4], [3, 4, 5], [50, 60, 70, 80, 90, 11, 12]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)) for p in prompts]
    final, freed = {}, False
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = out
        freed = freed or any(0 in seq.tables[window] for seq in engine.kv.sequences.values())
    assert freed  # some windowed block went back to the pool mid-request
    for prompt, rid in zip(prompts, ids):
        assert final[rid].token_ids == _reference(model, prompt, 14)
    assert engine.kv.num_live_blocks() == 0


@pytest.mark.parametrize(
    "model_type, overrides",
    [("llama", {}), ("mistral", dict(sliding_window=5)), ("llama", MLA)],
    ids=["llama", "mistral-window", "llama-mla"],
)
def test_cuda_dispatch_calls_the_kernels_with_block_tables(model_type, overrides, stories, monkeypatch):
    """With the kernel gate open (as on CUDA), prefill goes to paged_prefill_attention and decodes to
    paged_decode_attention (MLA: mla_decode), all with block tables of the engine's block size."""
    import hf_attn_patch.kernels.ops as kernels
    from hf_attn_patch.cache import metadata

    model = tiny_model(model_type, **overrides)
    prompts = [[5, 9, 13, 22, 40, 7, 8, 9, 10, 11], [3, 4, 5]]
    expected = [_reference(model, p, 6) for p in prompts]
    calls = []

    def spy(name):
        original = getattr(kernels, name)

        def call(*args, **kwargs):
            tables = args[3]
            calls.append((name, kwargs["block_size"], tables.shape[0], tables.shape[1]))
            return original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, call)

    for name in ("paged_decode_attention", "paged_prefill_attention", "mla_decode"):
        spy(name)
    monkeypatch.setattr(metadata, "use_kernels", lambda query: True)
    engine = Engine(model, stories[1], block_size=4, max_batch_tokens=32)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    names = {name for name, *_ in calls}
    decode = "mla_decode" if overrides.get("attention_variant") == "mla" else "paged_decode_attention"
    assert decode in names
    assert ("paged_prefill_attention" in names) == (decode == "paged_decode_attention")  # MLA prefill: torch
    assert all(size == 4 for _, size, _, _ in calls)
    assert all(width <= -(-16 // 4) for _, _, _, width in calls)  # block granularity: <= 16 positions in 4 blocks


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", -1), ("max_tokens", True), ("max_tokens", 2.0), ("temperature", float("nan")),
     ("temperature", float("inf")), ("temperature", True), ("temperature", "1"), ("top_k", -1), ("top_k", 1.5),
     ("top_p", 0), ("top_p", 1.5), ("top_p", float("nan")), ("seed", -1), ("seed", True), ("seed", 2**64),
     ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("ignore_eos", 1),
     ("logprobs", True), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 1.0), ("skip_special_tokens", None),
     ("response_format", "json"), ("num_speculative_tokens", -1), ("num_speculative_tokens", 65)],
)  # fmt: skip
def test_sampling_params_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_context_length_is_enforced(stories):
    model, tok = stories
    engine = Engine(model, tok, block_size=16)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"prompt: {limit + 1} tokens exceed the model's context of {limit}"):
        engine.add_request([5] * (limit + 1), SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match=f"{limit - 10} tokens \\+ max_tokens=11 = {limit + 1} exceed .* {limit}"):
        engine.add_request([5] * (limit - 10), SamplingParams(max_tokens=11))
    assert not engine.has_unfinished()


def _model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of ids [T] -> [T, V] (transformers' own forward)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_logprobs_and_prompt_logprobs_match_the_model(stories):
    """Generated and prompt logprobs are the raw distribution's (before temperature / top-k), top-k included;
    prompt logprobs bypass a prefix hit; max_tokens=0 only scores the prompt. fp32 log_softmax of the same logits
    through a differently packed attention: atol 1e-4 (logits ~1e1, depth 5, eps 1.2e-7, x100 safety)."""
    model, tok = stories
    engine = Engine(model, tok, block_size=4, max_batch_tokens=16)  # chunked prefill: prompt logprobs over chunks
    engine.generate(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0))  # leaves a prefix-cache entry
    echo, gen = engine.generate(
        [PROMPTS[0], PROMPTS[2]],
        [
            SamplingParams(max_tokens=0, prompt_logprobs=3),
            SamplingParams(max_tokens=12, temperature=1.5, top_k=3, seed=1, logprobs=5, prompt_logprobs=0),
        ],
    )
    assert echo.finish_reason == "length" and echo.token_ids == [] and echo.text == "" and echo.prefix_hit_tokens == 0
    for out, k in ((echo, 3), (gen, 0)):
        ids = out.prompt_token_ids
        ref = _model_logprobs(model, ids + out.token_ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for i in range(1, len(ids)):
            entry = out.prompt_logprobs[i]
            assert entry.token_id == ids[i] and abs(entry.logprob - float(ref[i - 1, ids[i]])) < 1e-4
            assert [t for t, _ in entry.top] == ref[i - 1].topk(k).indices.tolist()
    ref = _model_logprobs(model, gen.prompt_token_ids + gen.token_ids)
    start = len(gen.prompt_token_ids) - 1
    assert len(gen.logprobs) == len(gen.token_ids) == 12
    for j, (token, entry) in enumerate(zip(gen.token_ids, gen.logprobs)):
        assert entry.token_id == token and abs(entry.logprob - float(ref[start + j, token])) < 1e-4
        assert [t for t, _ in entry.top] == ref[start + j].topk(5).indices.tolist()


def test_text_is_exact_and_streams_with_its_leading_space(stories):
    """The text equals decode(prompt + tokens) minus decode(prompt): SentencePiece keeps " Lily"'s space; the
    streamed pieces add up to it; offsets point into it; a stop string is never streamed and then taken back."""
    model, tok = stories
    engine = Engine(model, tok, block_size=4)
    prompt = "Once upon a time, there was a little girl named"
    rid = engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0))
    stop_id = engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0, stop=[" She loved"]))
    streamed, final = {rid: "", stop_id: ""}, {}
    for out in engine.stream():
        streamed[out.request_id] += out.new_text
        assert streamed[out.request_id] == out.text
        final[out.request_id] = out
    out = final[rid]
    ids = out.prompt_token_ids
    full, head = tok.decode(ids + out.token_ids, skip_special_tokens=True), tok.decode(ids, skip_special_tokens=True)
    assert out.text == full[len(head) :] and out.text.startswith(" Lily")
    assert len(out.token_offsets) == len(out.token_ids) and out.token_offsets[0] == 0
    stopped = final[stop_id]
    assert stopped.finish_reason == "stop" and out.text.startswith(stopped.text + " She loved")


def test_seeded_request_does_not_depend_on_its_batch(stories):
    model, tok = stories
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=123)
    alone = Engine(model, tok, block_size=4).generate(PROMPTS[1], seeded)[0]
    others = [
        SamplingParams(max_tokens=12, temperature=1.2),
        SamplingParams(max_tokens=25, temperature=0),
        SamplingParams(max_tokens=8, temperature=0.5, top_k=5),
    ]
    batch = Engine(model, tok, block_size=4).generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]], [others[0], seeded, others[1], others[2]]
    )
    assert batch[1].token_ids == alone.token_ids and batch[1].text == alone.text


def test_a_step_is_values_applied_in_one_place(stories):
    """A step by hand: the plan names requests by id and cannot be changed, the runner answers with a value (no
    request changes before update_from_output), and update_from_output applies it: the drafts' verdict, the
    tokens, the logprobs. The same steps as engine.step(): the outputs equal generate()'s."""
    model, tok = stories
    engine = Engine(model, tok, block_size=4)
    prompt = "Tom and his dog went to the park. Tom and his dog went to the park. Tom and his dog"
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, num_speculative_tokens=4)
    rid = engine.add_request(prompt, params)
    request, tokens, drafts = engine.scheduler.requests[rid], [], 0
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()
        assert plan.req_ids == (rid,) and all(isinstance(v, (tuple, dict)) for v in vars(plan).values())
        with pytest.raises(AttributeError):
            plan.req_ids = ()
        before = (list(request.generated), request.computed)
        result = engine.runner.execute(plan, engine.processor.grammar_masks(plan))
        assert (list(request.generated), request.computed) == before  # nothing applied yet
        drafts += len(plan.sampling[rid].draft) if rid in plan.sampling else 0
        (out,) = engine.processor.update_from_output(plan, result)
        tokens += result.sampled.get(rid, ())
        assert out.token_ids == tokens[: len(out.token_ids)]
    assert out.finished and len(out.logprobs) == len(out.token_ids) == 12
    assert drafts > 0 and out.metrics["speculative_proposed"] == drafts
    assert out.token_ids == engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0].token_ids
