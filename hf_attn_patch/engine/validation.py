"""Bad input refused before any work, with a ValueError naming the field and its value: the engine's arguments
(check_engine_args) and each request (request_prompt_ids: the prompt's tokens, once the request is known to fit)."""

from __future__ import annotations

from .params import SamplingParams


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_engine_args(
    max_model_len, max_batch_tokens, block_size, max_num_seqs, memory_utilization, num_blocks, max_memory
) -> None:
    if max_model_len is not None and not _positive_int(max_model_len):
        raise ValueError(f"Engine: max_model_len={max_model_len!r} must be a positive integer or None")
    sizes = {"max_batch_tokens": max_batch_tokens, "block_size": block_size, "max_num_seqs": max_num_seqs}
    for name, value in sizes.items():
        if not _positive_int(value):
            raise ValueError(f"Engine: {name}={value!r} must be a positive integer")
    if memory_utilization is not None and (num_blocks is not None or max_memory is not None):
        raise ValueError(
            f"Engine: memory_utilization={memory_utilization!r} sizes the KV pool itself; give "
            f"num_blocks={num_blocks!r} / max_memory={max_memory!r} or it, not both"
        )


def request_prompt_ids(
    prompt, params, tokenizer, vocab_size: int, max_model_len: int | None, kv, hybrid: bool
) -> list[int]:
    """The prompt's token ids, once the request fits the model's context and vocabulary and the KV pool `kv`, and
    asks for nothing the model cannot do (speculation rolls drafts back: constant-state layers cannot)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
        prompt_ids = tokenizer(prompt).input_ids
    elif isinstance(prompt, (list, tuple)):
        prompt_ids = list(prompt)
    else:
        raise ValueError(f"prompt: expected text or a list of token ids, got {type(prompt).__name__}")
    ok = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt_ids)
    if not prompt_ids or not ok:
        raise ValueError(f"prompt: expected a non-empty text or token ids in [0, {vocab_size}), got {prompt!r:.80}")
    limit, total = max_model_len, len(prompt_ids) + params.max_tokens
    if limit is not None and len(prompt_ids) > limit:
        raise ValueError(f"prompt: {len(prompt_ids)} tokens exceed the model's context of {limit} tokens")
    if limit is not None and total > limit:
        raise ValueError(
            f"max_tokens: the prompt's {len(prompt_ids)} tokens + max_tokens={params.max_tokens} = "
            f"{total} exceed the model's context of {limit} tokens"
        )
    blocks, usable = -(-total // kv.block_size), kv.num_blocks - 1
    if blocks > usable:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens={params.max_tokens} needs {blocks} "
            f"blocks; the engine has {usable} (raise max_memory)"
        )
    if params.num_speculative_tokens and hybrid:
        raise ValueError(
            f"num_speculative_tokens={params.num_speculative_tokens}: speculative decoding rolls "
            "rejected drafts back, which this model's constant-state layers cannot; use 0"
        )
    return prompt_ids
