"""hf_attn_patch: GQA, MQA and MLA attention for Hugging Face transformers.

`import hf_attn_patch` calls `patch()`: a transformers model whose config carries `attention_variant` ("gqa" or
"mla", with DeepSeek's MLA field names) is built with our attention modules; every other model is untouched.
`generate()` gains a paged KV cache (`cache_implementation="paged_kv"`) and speculative decoding for any batch
size; `Engine` serves many requests with continuous batching. `unpatch()` restores transformers exactly.
"""

from __future__ import annotations

from .compat import check_transformers_version

check_transformers_version()  # refuses below the supported range, warns once above it

from .cache import CacheFullError, PagedKVCache  # noqa: E402
from ._patching import is_patched, patch, unpatch, unpatched  # noqa: E402
from .kv_memory import kv_cache_bytes  # noqa: E402
from .speculative import SpeculativeStats  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "CacheFullError",
    "Engine",
    "PagedKVCache",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeStats",
    "is_patched",
    "kv_cache_bytes",
    "patch",
    "unpatch",
    "unpatched",
]

patch()

_ENGINE_NAMES = ("Engine", "RequestOutput", "SamplingParams")


def __getattr__(name: str):
    """The engine (the top layer) loads on first use, so `import hf_attn_patch.cache` / `.attention` stay below it."""
    if name in _ENGINE_NAMES:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'hf_attn_patch' has no attribute {name!r}")
