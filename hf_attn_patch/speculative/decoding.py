"""Speculative decoding for any batch size: the loop that replaces generate()'s assisted decoding.

Each round: the drafter proposes up to k tokens per row; the target scores [last token, drafts] in one forward;
each row accepts its own number of drafts (rejection.py) and gains one more token from the target; rejected
columns become holes in that row (ragged.py). Rows that finish (EOS, max_new_tokens, a stopping criterion such as
stop strings, checked token by token inside the accepted run) leave the batch at once.

Keywords, as in transformers: `assistant_model=`, `assistant_early_exit=`, `prompt_lookup_num_tokens=`
(`max_matching_ngram_size=`). Ours, accepted by generate() while patched: `draft_length="adaptive"` (default) or
an int for a fixed length, and `speculative_stats=SpeculativeStats()` to receive acceptance and timing figures.
Grammar processors (response_format= / grammar=) are driven per row by grammar_rows.py: drafts are checked
against the grammar (and a checked JSON Schema's exact checks) before verification and the states roll back what
was rejected; rows whose check failed are retried by generate() afterwards (grammar/retry.py), as in plain decoding.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput
from ..compat import get_cache

from .draft_length import DraftLength
from .drafters import Draft, ModelDrafter, PromptLookupDrafter
from .combined import LookupOrFeatureDrafter
from .feature_drafter import FeatureDrafter, FeatureDrafterForCausalLM
from .grammar_rows import GrammarRows, grammar_processors
from .ragged import RaggedModel, check_supported
from .rejection import verify_greedy, verify_sampling
from .sequences import Sequences

logger = logging.getLogger(__name__)

# generate()'s extra keywords reach the decoding loop through this (set by the patched generate()).
generate_options: contextvars.ContextVar[dict] = contextvars.ContextVar("hf_attn_patch_speculative", default={})


@dataclass
class SpeculativeStats:
    """Filled in by generate(..., speculative_stats=stats)."""

    rounds: int = 0  # verification forwards
    row_steps: int = 0  # (row, round) pairs: a row verified in a round
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens emitted (accepted drafts + one target token per row-step), before truncation at stops
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    draft_lengths: list[int] = field(default_factory=list)  # k chosen in each round

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.accepted / self.row_steps if self.row_steps else 0.0

    @property
    def drafter_time_share(self) -> float:
        return self.draft_seconds / self.total_seconds if self.total_seconds else 0.0

    def summary(self) -> dict:
        return {
            "rounds": self.rounds,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_per_step": round(self.mean_accepted_per_step, 3),
            "tokens_per_step": round(self.emitted / self.row_steps, 3) if self.row_steps else 0.0,
            "drafter_time_share": round(self.drafter_time_share, 4),
        }


def make_drafter(model, generation_config, assistant_model):
    """(drafter, max draft length) from generate()'s keywords."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    lookup_tokens, lookup = generation_config.prompt_lookup_num_tokens, None
    if lookup_tokens is not None:
        ngram = generation_config.max_matching_ngram_size or 2
        # single-token matches propose mostly junk on free text: at least 2 tokens must match when allowed
        lookup = PromptLookupDrafter(max_ngram=ngram, min_ngram=min(2, ngram))
    if isinstance(assistant_model, FeatureDrafterForCausalLM):  # with lookup too: lookup where the history repeats
        feature = FeatureDrafter(model, assistant_model, vocab)
        longest = assistant_model.config.max_draft_tokens
        if lookup is None:
            return feature, longest
        return LookupOrFeatureDrafter(lookup, feature, longest), max(lookup_tokens, longest)
    if lookup is not None:
        return lookup, lookup_tokens
    if generation_config.assistant_early_exit is not None:
        drafter = ModelDrafter(model, vocab, num_layers=generation_config.assistant_early_exit)
        return drafter, generation_config.num_assistant_tokens or 5
    if assistant_model is None:
        raise ValueError("speculative decoding needs assistant_model, assistant_early_exit or prompt_lookup_num_tokens")
    return ModelDrafter(assistant_model, vocab), assistant_model.generation_config.num_assistant_tokens or 5


def unsupported_reason(generation_config, model_kwargs, assistant_tokenizer, streamer, batch_size) -> str | None:
    """Why our loop cannot run this call (then transformers' own runs it at batch 1), or None."""
    if assistant_tokenizer is not None:
        return "assistant_tokenizer (different tokenizers)"
    if getattr(generation_config, "use_mtp", False) or getattr(generation_config, "speculation_type", None):
        return "multi-token-prediction drafters"
    if generation_config.assistant_ensemble_weight is not None:
        return "assistant_ensemble_weight"
    if generation_config.assistant_confidence_threshold not in (None, 0.4):
        return "assistant_confidence_threshold"
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag):
            return flag
    if model_kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds"
    if streamer is not None and batch_size > 1:
        return "a streamer with batch_size > 1"
    return None


def speculative_decoding(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    assistant_model=None,
    **model_kwargs,
):
    """generate()'s decoding method for assisted generation (any batch size); see the module docstring."""
    drafter, max_draft = make_drafter(model, generation_config, assistant_model)
    try:
        return _decode(
            model,
            drafter,
            max_draft,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            streamer,
            **model_kwargs,
        )
    finally:
        drafter.finish()


def _decode(
    model,
    drafter,
    max_draft,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    streamer,
    **model_kwargs,
):
    options = generate_options.get()
    stats = options.get("speculative_stats") or SpeculativeStats()
    started = time.perf_counter()
    if model.config.is_encoder_decoder:
        raise ValueError("speculative decoding here supports decoder-only models")
    batch, prompt_width = input_ids.shape
    check_supported(model.config.get_text_config(decoder=True), batch)
    if not model_kwargs.get("use_cache", True):
        raise ValueError("speculative decoding needs use_cache=True")
    cache = get_cache(model_kwargs)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()

    schedule = options.get("draft_length", "adaptive")
    if schedule != "adaptive" and not (isinstance(schedule, int) and schedule >= 1):
        raise ValueError(f"draft_length: expected 'adaptive' or an int >= 1, got {schedule!r}")
    # n-gram drafts cost nothing to make: start at the longest; a separate model drafter starts short (2) and
    # adapts; early exit starts at 1 (a draft token costs a fixed share of a target forward, and layers that were
    # not trained to exit early rarely agree with the last one)
    start = max_draft if isinstance(drafter, PromptLookupDrafter) else 1 if getattr(drafter, "early_exit", False) else 2
    lengths = DraftLength(
        max_draft if schedule == "adaptive" else schedule, batch, adaptive=schedule == "adaptive", start=start
    )

    do_sample = generation_config.do_sample
    pad_id = generation_config._pad_token_tensor
    pad_id = int(pad_id) if pad_id is not None else 0
    eos = generation_config._eos_token_tensor
    eos_ids = set(eos.reshape(-1).tolist()) if eos is not None else set()
    max_new = generation_config.max_length - prompt_width
    other_criteria = StoppingCriteriaList(
        [c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    )

    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    sequences = Sequences(input_ids, attention_mask, pad_id)

    grammar_list = grammar_processors(logits_processor)
    grammars = {id(p): GrammarRows(p, input_ids.cpu()) for p in grammar_list}

    def process(tokens, logits, position=None):
        """generate()'s processors in their order; grammars mask verification `position` j, or (position None)
        a drafter's next draft token."""
        for processor in logits_processor:
            if id(processor) in grammars:
                rows = grammars[id(processor)]
                logits = rows.draft_mask(tokens, logits) if position is None else rows.apply(logits, position)
            else:
                logits = processor(tokens, logits)
        return logits

    def pick(scores):
        return torch.multinomial(scores.softmax(-1), 1).squeeze(1) if do_sample else scores.argmax(-1)

    # Prefill exactly as generate() does (a PagedKVCache learns each row's padding and prefix hits there).
    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    target = RaggedModel(model, cache, attention_mask, attention_mask.long().sum(1))
    drafter.start(sequences, attention_mask, target)
    for rows in grammars.values():
        rows.prepare(_empty_draft(input_ids[:, -1]), cut=False)
    first = pick(process(sequences.tokens, outputs.logits[:, -1].float(), position=0))
    del outputs
    pending = first
    finished = _emit(sequences, [[t] for t in first.tolist()], eos_ids, max_new, other_criteria)
    for rows in grammars.values():
        rows.commit([[t] for t in first.tolist()])
    _stream(streamer, first)

    while True:
        pending, active = _drop_finished(finished, pending, target, drafter, sequences, lengths, grammars.values())
        if not active:
            break
        k = lengths.choose()
        round_start = time.perf_counter()
        for rows in grammars.values():
            rows.begin_draft(sequences.tokens.shape[1])
        draft = drafter.propose(sequences, k, process, do_sample) if k else _empty_draft(pending)
        for rows in grammars.values():
            rows.end_draft()
        k = int(draft.lengths.max()) if k else 0  # verify no wider than the longest proposal (n-gram misses)
        draft = Draft(draft.tokens[:, :k], draft.lengths, None if draft.probs is None else draft.probs[:, :k])
        for rows in grammars.values():  # masks of every draft position; point-mass / greedy drafts end where invalid
            draft = rows.prepare(draft, cut=draft.probs is None or not do_sample)
        drafted = time.perf_counter()

        target.mark()
        logits = target.forward(torch.cat([pending[:, None], draft.tokens], dim=1))  # [B, k+1, V]
        scores = torch.stack(
            [process(sequences.with_drafts(draft.tokens[:, :j]), logits[:, j], j) for j in range(k + 1)], dim=1
        )
        if do_sample:
            accepted, next_token = verify_sampling(scores.softmax(-1), draft.tokens, draft.lengths, draft.probs)
        else:
            accepted, next_token = verify_greedy(scores, draft.tokens, draft.lengths)
        target.keep(accepted + 1)  # the pending token and the accepted drafts stay in the cache
        drafter.accepted(accepted)
        counts, nexts, drafts = accepted.tolist(), next_token.tolist(), draft.tokens.tolist()
        new_tokens = [drafts[b][: counts[b]] + [nexts[b]] for b in range(len(counts))]
        finished = _emit(sequences, new_tokens, eos_ids, max_new, other_criteria)
        for rows in grammars.values():
            rows.commit(new_tokens)
        pending = next_token
        if streamer is not None:
            _stream(streamer, torch.tensor(new_tokens[0]))

        done = time.perf_counter()
        lengths.update(k, accepted, draft.lengths, verify_seconds=done - drafted, draft_seconds=drafted - round_start)
        stats.rounds += 1
        stats.row_steps += len(counts)
        stats.proposed += int(draft.lengths.sum())
        stats.accepted += sum(counts)
        stats.emitted += sum(counts) + len(counts)
        stats.draft_seconds += drafted - round_start
        stats.verify_seconds += done - drafted
        stats.draft_lengths.append(k)

    if streamer is not None:
        streamer.end()
    for processor in grammar_list:  # final states back: generate() retries rows whose JSON Schema check failed
        grammars[id(processor)].finish(processor)
    stats.total_seconds += time.perf_counter() - started
    logger.debug("speculative decoding: %s", stats.summary())
    result = sequences.output(input_ids)
    if generation_config.return_dict_in_generate:
        # the cache has per-row holes and lost its finished rows: it is not returned
        return GenerateDecoderOnlyOutput(sequences=result)
    return result


def _emit(sequences: Sequences, new_tokens: list[list[int]], eos_ids, max_new: int, criteria) -> list[bool]:
    """Append each row's new tokens, cut at the first that ends the row; returns which rows finished."""
    finished = []
    for b, tokens in enumerate(new_tokens):
        room = max_new - len(sequences.generated[sequences.rows[b]])
        cut = min(len(tokens), room)
        stops = [i for i, t in enumerate(tokens[:cut]) if t in eos_ids]
        if stops:
            cut = stops[0] + 1
        new_tokens[b] = tokens[:cut]
        finished.append(cut == room or bool(stops))
    if len(criteria):
        _cut_at_criteria(sequences, new_tokens, finished, criteria)
    sequences.extend(new_tokens)
    return finished


def _cut_at_criteria(sequences: Sequences, new_tokens, finished, criteria) -> None:
    """Stop strings and other criteria: test each row after each of its new tokens, cut at the first hit."""
    histories = [sequences.row(b).tolist() for b in range(len(new_tokens))]
    for j in range(max(len(t) for t in new_tokens)):
        rows = [history + tokens[: j + 1] for history, tokens in zip(histories, new_tokens)]
        width = max(len(row) for row in rows)
        padded = [[sequences.pad_token_id] * (width - len(row)) + row for row in rows]
        hit = criteria(torch.tensor(padded, dtype=torch.long, device=sequences.tokens.device), None)
        for b, tokens in enumerate(new_tokens):
            if j < len(tokens) and bool(hit[b]):
                new_tokens[b] = tokens[: j + 1]
                finished[b] = True


def _drop_finished(finished, pending, target, drafter, sequences, lengths, grammars):
    if not any(finished):
        return pending, True
    keep = torch.tensor([b for b, f in enumerate(finished) if not f], dtype=torch.long, device=pending.device)
    if keep.numel() == 0:
        return pending, False
    target.select(keep)
    drafter.select(keep)
    sequences.select(keep)
    lengths.select(keep)
    for rows in grammars:
        rows.select(keep)
    return pending[keep], True


def _empty_draft(pending: torch.Tensor) -> Draft:
    return Draft(pending.new_zeros((pending.shape[0], 0)), torch.zeros_like(pending))


def _stream(streamer, tokens: torch.Tensor) -> None:
    if streamer is not None:
        streamer.put(tokens.cpu())
