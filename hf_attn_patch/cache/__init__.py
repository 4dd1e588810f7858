"""Paged KV cache: block pool, prefix hashing, and the transformers `Cache` subclass over them."""

from .block_pool import NULL_BLOCK, BlockPool, CacheFullError
from .paged_cache import PagedKVCache

__all__ = ["NULL_BLOCK", "BlockPool", "CacheFullError", "PagedKVCache"]
