"""PagedLayer: one attention layer of a PagedKVCache as transformers' Cache sees it (its length, its storage); the
cache does the work."""

from __future__ import annotations

from transformers.cache_utils import CacheLayerMixin

from .kv_storage import KVStorage


class PagedLayer(CacheLayerMixin):
    """A view of one attention layer inside a PagedKVCache; the cache does the work."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache, layer_idx: int, window: int | None):
        super().__init__()
        self.cache, self.layer_idx, self.window = cache, layer_idx, window
        self.is_sliding = window is not None
        self.length = 0  # tokens this layer has seen (logical, padding included)
        self.storage: KVStorage | None = None  # made at the first write, laid out by the layer's CacheSpec

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache._layer_update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
