"""generate(cache_implementation="paged_kv"): what the patch puts in GenerationMixin for the paged cache
(installed by _patching.py, which restores the originals). transformers' cache names are a fixed tuple and its
cache construction has no hook, so:

- `with_paged_cache_name(names)`: ALL_CACHE_IMPLEMENTATIONS plus "paged_kv" ("paged" already means transformers'
  own continuous batching);
- `prepare_cache_with_paged(original)`: `_prepare_cache_for_generation` builds a PagedKVCache for that name (sized
  for every row to reach max length unless `cache_config` gives num_blocks / max_memory);
- `prefill_with_paged(original)`: `_prefill` tells the PagedKVCache where each row's prompt starts (left padding)
  and which prompt blocks it already holds (prefix caching) before the prefill forward, and the generation's
  max_length (so the rows are laid out to be read as one view).
"""

from __future__ import annotations

from ..compat import CACHE, get_cache
from .paged_cache import PagedKVCache

PAGED_CACHE_NAME = "paged_kv"


def with_paged_cache_name(names: tuple[str, ...]) -> tuple[str, ...]:
    return names + (PAGED_CACHE_NAME,)


def pool_blocks_for_generation(rows: int, max_length: int, block_size: int) -> int:
    """Blocks of the pool generate(cache_implementation="paged_kv") makes: enough for every row to reach max_length,
    one block of slack per row, and the null block."""
    return rows * (-(-max_length // block_size) + 1) + 1


def prepare_cache_with_paged(original):
    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        if generation_config.cache_implementation != PAGED_CACHE_NAME or get_cache(model_kwargs) is not None:
            return original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        options = dict(generation_config.cache_config or {})
        block_size = options.get("block_size", 16)
        if "num_blocks" not in options and "max_memory" not in options:  # enough for every row to reach max length
            rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
            options["num_blocks"] = pool_blocks_for_generation(rows, max_cache_length, block_size)
        model_kwargs[CACHE] = PagedKVCache(self.config.get_text_config(decoder=True), **options)

    _prepare_cache_for_generation.__wrapped__ = original
    return _prepare_cache_for_generation


def prefill_with_paged(original):
    def _prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=True):
        cache = get_cache(model_kwargs)
        if isinstance(cache, PagedKVCache) and is_first_iteration and model_kwargs.get("inputs_embeds") is None:
            longest = generation_config.max_length  # rows laid out for it (None where it is shorter than the prompt)
            longest = longest if isinstance(longest, int) and longest >= input_ids.shape[1] else None
            cache.start_request(input_ids, model_kwargs.get("attention_mask"), max_length=longest)
        return original(self, input_ids, generation_config, model_kwargs, is_first_iteration=is_first_iteration)

    _prefill.__wrapped__ = original
    return _prefill
