"""Speculative decoding for batch > 1: greedy identity with plain generate(), exact rejection sampling, stops."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import hf_attn_patch
from hf_attn_patch.models.pretrained import load_default
from hf_attn_patch.speculative import SpeculativeStats, verify_greedy, verify_sampling
from hf_attn_patch.speculative.draft_length import DraftLength
from hf_attn_patch.speculative.sequences import Sequences

from .conftest import tiny_model

MLA = dict(attention_variant="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.fixture(scope="module")
def stories():
    model, tokenizer = load_default()
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return model, tokenizer


PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She liked to play with her ball. Once upon a time,",
    "The cat sat",
    "Tom and his dog went to the park. Tom and his dog",
]
DRAFTERS = {
    "ngram": lambda model: dict(prompt_lookup_num_tokens=4),
    "early_exit": lambda model: dict(assistant_early_exit=2),
    "assistant": lambda model: dict(assistant_model=model),  # the target drafting for itself: every draft accepted
}


def _generate(model, enc, **kw):
    stats = SpeculativeStats()
    out = model.generate(**enc, do_sample=False, speculative_stats=stats, **kw)
    return out, stats


@pytest.mark.parametrize("cache", [None, "paged_kv"])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_batch_identical_to_plain_generate(stories, drafter, cache):
    model, tok = stories
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=32, cache_implementation=cache)
    reference = model.generate(**enc, do_sample=False, **kw)
    out, stats = _generate(model, enc, **kw, **DRAFTERS[drafter](model))
    assert torch.equal(out, reference)
    assert stats.rounds > 0 and stats.row_steps >= stats.rounds  # our loop ran, on several rows per round
    assert stats.rounds < 32  # drafts were accepted: fewer verification rounds than tokens
    if drafter == "assistant":
        assert stats.acceptance_rate == 1.0


@pytest.mark.parametrize("k", [1, 3, 7])
def test_fixed_draft_lengths_stay_identical(stories, k):
    model, tok = stories
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    reference = model.generate(**enc, do_sample=False, max_new_tokens=20)
    out, stats = _generate(model, enc, max_new_tokens=20, assistant_early_exit=3, draft_length=k)
    assert torch.equal(out, reference)
    assert set(stats.draft_lengths) == {k}


@pytest.mark.parametrize(
    "model_type, overrides",
    [("llama", {}), ("llama", MLA), ("gpt2", {}), ("opt", {}), ("gpt_neox", {}), ("deepseek_v3", {})],
    ids=["llama", "llama-mla", "gpt2", "opt", "gpt_neox", "deepseek_v3"],
)
def test_greedy_identical_across_architectures(model_type, overrides, padded_batch):
    model = tiny_model(model_type, **overrides)
    drafter = tiny_model(model_type, seed=1, **overrides)  # a different model: some drafts get rejected
    ids, mask = padded_batch
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kw)
    for extra in (dict(assistant_model=drafter), dict(prompt_lookup_num_tokens=3), dict(assistant_early_exit=1)):
        assert torch.equal(model.generate(ids, **kw, **extra), reference), extra


def test_early_exit_leaves_the_model_untouched(stories):
    """Drafting runs a view of the first layers: the user's model keeps its layer list and config throughout
    (another thread may run it meanwhile), and every forward of its first layer sees them whole."""
    model, tok = stories
    layers, config = model.model.layers, model.config
    full = config.num_hidden_layers
    seen = []
    hook = layers[0].register_forward_pre_hook(
        lambda *_: seen.append((model.model.layers is layers, len(model.model.layers), config.num_hidden_layers))
    )
    try:
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        _, stats = _generate(model, enc, max_new_tokens=12, assistant_early_exit=2, draft_length=3)
    finally:
        hook.remove()
    assert stats.proposed > 0 and len(seen) > stats.rounds  # drafter forwards ran through the shared first layer
    assert set(seen) == {(True, full, full)}
    assert [type(m) for m in model.modules()].count(type(layers)) == 1


FINAL_NORM = {
    "llama": "model.norm",
    "gpt2": "transformer.ln_f",
    "opt": "model.decoder.final_layer_norm",
    "gpt_neox": "gpt_neox.final_layer_norm",
    "deepseek_v3": "model.norm",
}


@pytest.mark.parametrize("model_type", list(FINAL_NORM))
def test_early_exit_view_equals_the_first_layers_of_the_model(model_type):
    """The view's logits are the final norm and LM head applied to the full model's hidden state after layer n
    (hidden_states[n] of output_hidden_states; the last entry is post-norm, so n < num_layers is what we compare)."""
    from hf_attn_patch.speculative.ragged import early_exit_view

    model = tiny_model(model_type, num_hidden_layers=3) if model_type != "gpt2" else tiny_model("gpt2", n_layer=3)
    ids = torch.randint(3, 97, (2, 7))
    view = early_exit_view(model, 2)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[2]
        norm = model.get_submodule(FINAL_NORM[model_type])
        expected = model.get_output_embeddings()(norm(hidden))
        got = view(ids).logits
    # fp32, same ops in the same order: rounding only, eps 1.2e-7 x sqrt(hidden 64) x 3 layers x logits <= 5 ~ 1e-5
    assert torch.allclose(got, expected, atol=1e-5)  # fp32, same ops in the same order: rounding only
    assert model.config.get_text_config(decoder=True).num_hidden_layers == 3


def test_eos_inside_a_draft_and_max_new_tokens(stories):
    model, tok = stories
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    plain = model.generate(**enc, do_sample=False, max_new_tokens=30)
    eos = int(plain[1, enc.input_ids.shape[1] + 5])  # a token row 1 emits mid-way: rows now end at different steps
    for max_new in (30, 7):
        reference = model.generate(**enc, do_sample=False, max_new_tokens=max_new, eos_token_id=eos)
        out, _ = _generate(model, enc, max_new_tokens=max_new, eos_token_id=eos, assistant_model=model, draft_length=6)
        assert torch.equal(out, reference)
    assert (reference == eos).any()


def test_stop_strings_per_row(stories):
    model, tok = stories
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=40, stop_strings=["park", "."], tokenizer=tok)
    reference = model.generate(**enc, do_sample=False, **kw)
    out, _ = _generate(model, enc, assistant_model=model, draft_length=5, **kw)
    assert torch.equal(out, reference)


def test_sliding_window_batches_refused():
    model = tiny_model("mistral")
    ids = torch.randint(3, 97, (2, 6))
    with pytest.raises(ValueError, match="sliding_window=5"):
        model.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=2, do_sample=False, pad_token_id=0)
    model.generate(ids[:1], max_new_tokens=4, prompt_lookup_num_tokens=2, do_sample=False)  # batch 1 runs


def test_unsupported_options_at_batch_gt_1_raise_and_fall_back_at_batch_1(stories):
    model, tok = stories
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    with pytest.raises(ValueError, match="batch_size=2 does not support output_scores"):
        model.generate(**enc, assistant_model=model, **kw)
    one = tok(PROMPTS[:1], return_tensors="pt")
    assert len(model.generate(**one, assistant_model=model, **kw).scores) == 5  # transformers' own loop at batch 1


def test_unpatched_transformers_refuses_batches(stories):
    model, tok = stories
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    with hf_attn_patch.unpatched(), pytest.raises(ValueError, match="only supported for batch_size = 1"):
        model.generate(**enc, max_new_tokens=3, assistant_model=model)


# --- verification math -------------------------------------------------------------------------------------------


def test_verify_greedy_counts_leading_matches():
    scores = torch.full((3, 4, 5), -1.0)
    best = torch.tensor([[1, 2, 3, 4], [1, 0, 3, 4], [2, 2, 2, 2]])
    scores.scatter_(2, best[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    accepted, nxt = verify_greedy(scores, drafts, torch.tensor([3, 3, 3]))
    assert accepted.tolist() == [3, 1, 0] and nxt.tolist() == [4, 0, 2]
    accepted, nxt = verify_greedy(scores, drafts, torch.tensor([2, 3, 0]))  # shorter proposals cap acceptance
    assert accepted.tolist() == [2, 1, 0] and nxt.tolist() == [3, 0, 2]


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    empirical = torch.bincount(samples, minlength=probs.numel()).double() / samples.numel()
    return 0.5 * float((empirical - probs.double()).abs().sum())


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_emits_target_distribution(point_mass):
    """vLLM-style check: each emitted token, at each position, is distributed as the target's p (not q)."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, n = 6, 3, 200_000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)  # a drafter that disagrees with p
    if point_mass:  # n-gram style: a fixed guess, no probabilities
        drafts = torch.tensor([[2, 4, 1]]).expand(n, k)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1)
        draft_probs = q.expand(n, k, vocab)
    accepted, nxt = verify_sampling(p.expand(n, k + 1, vocab), drafts, torch.full((n,), k), draft_probs, gen)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)  # the first emitted token of each row
    # independent draws from p itself, to size the tolerance: sampling noise only
    baseline = _tv(torch.multinomial(p[0], n, replacement=True, generator=gen), p[0])
    assert _tv(first, p[0]) < 3 * baseline + 2e-3
    # the second emitted token, among rows that accepted the first draft, is distributed as p_1
    second_rows = accepted > 0
    second = torch.where(accepted[second_rows] > 1, drafts[second_rows, 1], nxt[second_rows])
    assert _tv(second, p[1]) < 4 * (2 * baseline) + 3e-3
    assert _tv(first, q[0] if not point_mass else torch.nn.functional.one_hot(torch.tensor(2), vocab).float()) > 0.05


def test_speculative_sampling_in_generate_matches_target_marginal():
    """End to end, batch 4000: the second generated token's empirical distribution converges to the target's exact
    marginal sum_t1 p(t1) p(t2 | t1), with temperature and top-k applied to both models."""
    assert_second_token_marginal(tiny_model("llama", seed=0), tiny_model("llama", seed=3))


def assert_second_token_marginal(target, drafter) -> None:
    """Sampling 4000 rows of 2 tokens with `drafter` (draft length 2): both tokens follow the target's exact law."""
    prompt = torch.tensor([[5, 17, 33]])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(12)])
    with torch.no_grad():
        p1 = processors(prompt, target(prompt).logits[:, -1]).softmax(-1)[0]  # [V]
        firsts = torch.arange(p1.numel())[:, None]
        both = torch.cat([prompt.expand(p1.numel(), -1), firsts], 1)
        p2 = processors(both, target(both).logits[:, -1]).softmax(-1)  # [V, V]
    marginal = (p1[:, None] * p2).sum(0)
    n = 4000
    torch.manual_seed(0)
    stats = SpeculativeStats()
    out = target.generate(
        prompt.expand(n, -1),
        max_new_tokens=2,
        do_sample=True,
        temperature=0.7,
        top_k=12,
        top_p=1.0,
        assistant_model=drafter,
        draft_length=2,
        pad_token_id=0,
        speculative_stats=stats,
    )
    assert stats.proposed > 0 and 0 < stats.acceptance_rate < 1  # drafts were verified, some rejected
    tv = _tv(out[:, -1], marginal)
    noise = _tv(torch.multinomial(marginal, n, replacement=True), marginal)
    assert tv < 2.5 * noise + 0.02, (tv, noise)
    assert _tv(out[:, -2], p1) < 2.5 * noise + 0.02


# --- pieces ---------------------------------------------------------------------------------------------------


def test_adaptive_draft_length_follows_acceptance():
    good, bad = DraftLength(8, batch_size=2), DraftLength(8, batch_size=2)
    for _ in range(20):
        k = good.choose()
        good.update(k, torch.tensor([k, k]), torch.tensor([k, k]), verify_seconds=1.0, draft_seconds=0.05 * k)
        k = bad.choose()
        bad.update(k, torch.tensor([0, 0]), torch.tensor([k, k]), verify_seconds=1.0, draft_seconds=0.3 * k)
    assert good.choose() == 8
    assert bad.choose() <= 1
    fixed = DraftLength(5, batch_size=1, adaptive=False)
    assert fixed.choose() == 5


def test_adaptive_draft_length_remembers_what_drafting_costs():
    """A drafter that accepts a quarter of its tokens at half a round per token does not pay (E(1)/t(1) =
    1.25 / 1.5 < 1): after its first rounds only k = 1 probes remain, spaced 16, 32, 64 rounds apart, even after
    long runs of plain rounds (which carry no drafting cost: the per-token cost must not be forgotten)."""
    lengths, chosen = DraftLength(8, batch_size=1, start=1), []
    for round_index in range(200):
        k = lengths.choose()
        chosen.append(k)
        accepted = torch.tensor([1 if k and round_index % 4 == 0 else 0])
        lengths.update(k, accepted, torch.tensor([k]), verify_seconds=1.0 + 0.02 * k, draft_seconds=0.5 * k)
    probes = [i for i, k in enumerate(chosen) if k and i > 3]
    assert set(chosen[4:]) == {0, 1} and len(probes) <= 6, chosen
    # where verifying a second token per row costs a whole round (a CPU at batch > 1), a probe costs 1.5 rounds:
    # they are spaced >= 1.5 / PROBE_BUDGET = 75 rounds apart
    lengths, chosen = DraftLength(8, batch_size=4, start=1), []
    for _ in range(200):
        k = lengths.choose()
        chosen.append(k)
        lengths.update(
            k, torch.zeros(4, dtype=torch.long), torch.full((4,), k), verify_seconds=1.0 + k, draft_seconds=0.5 * k
        )
    probes = [i for i, k in enumerate(chosen) if k]
    assert probes[0] == 0 and all(b - a >= 75 for a, b in zip(probes, probes[1:])) and len(probes) <= 3, probes


def test_sequences_keep_rows_right_aligned():
    ids = torch.tensor([[0, 0, 7, 8], [1, 2, 3, 4]])
    seqs = Sequences(ids, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), pad_token_id=0)
    seqs.extend([[9, 10, 11], [5]])
    assert seqs.row(0).tolist() == [7, 8, 9, 10, 11] and seqs.row(1).tolist() == [1, 2, 3, 4, 5]
    assert seqs.tokens.shape == (2, 5)
    seqs.select(torch.tensor([1]))
    seqs.extend([[6]])
    assert seqs.output(ids).tolist() == [[0, 0, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 0]]


def test_bad_draft_length_is_refused(stories):
    model, tok = stories
    enc = tok(PROMPTS[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="draft_length: expected 'adaptive' or an int >= 1, got 0"):
        model.generate(**enc, max_new_tokens=3, prompt_lookup_num_tokens=2, draft_length=0)
    with pytest.raises(ValueError, match="assistant_early_exit=9"):
        model.generate(**enc, max_new_tokens=3, assistant_early_exit=9)


@pytest.mark.smollm2
def test_smollm2_batch_prompt_lookup_identical():
    model, tok = hf_attn_patch.models.pretrained.load_smollm2()
    tok.padding_side = "left"
    text = "The quick brown fox jumps over the lazy dog near the river bank. It was a sunny day."
    chats = [
        [{"role": "user", "content": f"{task}: {text}"}] for task in ("Repeat this text exactly", "Fix the grammar")
    ]
    prompts = [tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    enc = tok(prompts, return_tensors="pt", padding=True)
    reference = model.generate(**enc, max_new_tokens=24, do_sample=False)
    out, stats = _generate(model, enc, max_new_tokens=24, prompt_lookup_num_tokens=6)
    assert torch.equal(out, reference)
    assert stats.accepted > 0


# --- with grammars ------------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}  # fmt: skip
FORMAT = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_grammar_constrained_speculative_equals_plain(stories, drafter):
    """Drafts are checked against each row's grammar before verification; greedy stays identical to plain
    constrained generate(), and the output validates."""
    import json

    import jsonschema

    model, tok = stories
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=48, response_format=FORMAT, tokenizer=tok)
    reference = model.generate(**enc, do_sample=False, **kw)
    out, stats = _generate(model, enc, **kw, **DRAFTERS[drafter](model), draft_length=4)
    assert torch.equal(out, reference)
    for row in out[:, enc.input_ids.shape[1] :]:
        jsonschema.validate(json.loads(tok.decode(row, skip_special_tokens=True)), SCHEMA)
    if drafter == "assistant":  # the drafter's own logits are masked too: every draft is accepted
        assert stats.acceptance_rate == 1.0 and stats.rounds <= 48 / 4


def test_grammar_speculative_sampling_validates(stories):
    import json

    import jsonschema

    model, tok = stories
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(
        **enc, max_new_tokens=48, do_sample=True, response_format=FORMAT, tokenizer=tok, assistant_early_exit=3
    )
    for row in out[:, enc.input_ids.shape[1] :]:
        jsonschema.validate(json.loads(tok.decode(row, skip_special_tokens=True)), SCHEMA)


def test_generate_grammar_keywords(stories):
    model, tok = stories
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    out = model.generate(
        **enc,
        max_new_tokens=20,
        do_sample=False,
        tokenizer=tok,
        grammar=[{"type": "regex", "pattern": "(yes|no)!"}, {"type": "choice", "choices": ["red", "blue"]}],
    )
    texts = tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    assert texts[0] in ("yes!", "no!") and texts[1] in ("red", "blue")
    with pytest.raises(ValueError, match="tokenizer: required"):
        model.generate(**enc, max_new_tokens=3, response_format=FORMAT)
    with pytest.raises(ValueError, match="response_format"):
        model.generate(**enc, max_new_tokens=3, response_format={"type": "xml"}, tokenizer=tok)
