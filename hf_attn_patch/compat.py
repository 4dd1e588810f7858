"""What differs between the transformers minors the patch supports, in one place.

Supported: FLOOR (the newest minor vLLM's CPU build allows) to NEWEST_TESTED. `check_transformers_version` runs once
at import: below FLOOR it refuses with the pip line, above NEWEST_TESTED it warns once and runs. Each shim below
names the versions it serves; the rest of the package imports these names and never compares versions itself.
Adding a minor: run the suite on it (`make test-compat TRANSFORMERS=5.x`), add a shim here for whatever moved,
then raise NEWEST_TESTED (and the Makefile's default).
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings

import transformers  # noqa: F401  (loaded here; its version is read from sys.modules)
from packaging.version import Version

FLOOR = "5.19"
NEWEST_TESTED = "5.25"
PIP_LINE = f'pip install "transformers>={FLOOR},<6"'

__all__ = [
    "CACHE",
    "FLOOR",
    "NEWEST_TESTED",
    "attention_cache",
    "cache_kwarg",
    "check_transformers_version",
    "constructor_signature",
    "get_cache",
    "patch_rows",
    "placeholder_cache_layer",
    "transformers_minor",
]


def _installed_version() -> str:
    # looked up at each call: importing some modeling modules makes transformers put a new module object under its
    # name in sys.modules, so a reference held since import may be stale
    return sys.modules["transformers"].__version__


def transformers_minor(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: the installed transformers)."""
    return Version(_installed_version() if version is None else version).release[:2]


_warned_newer: set[str] = set()


def check_transformers_version(version: str | None = None) -> None:
    """ImportError below FLOOR (naming the pip line); one UserWarning per version above NEWEST_TESTED."""
    version = _installed_version() if version is None else version
    if transformers_minor(version) < transformers_minor(FLOOR):
        raise ImportError(f"hf_attn_patch needs transformers {FLOOR} or newer, found {version}: {PIP_LINE}")
    if transformers_minor(version) > transformers_minor(NEWEST_TESTED) and version not in _warned_newer:
        _warned_newer.add(version)
        warnings.warn(
            f"hf_attn_patch is tested with transformers {FLOOR} to {NEWEST_TESTED}, found {version}: it "
            "runs, but internals it patches may have moved",
            UserWarning,
            stacklevel=3,
        )


_INSTALLED = transformers_minor()

# -- the cache's keyword ----------------------------------------------------------------------------------------
# 5.24+: `cache=` in every model's, decoder layer's and attention's forward, in prepare_inputs_for_generation, the
#        masks (create_causal_mask) and generate()'s model_kwargs and outputs (`past_key_values=` still works there,
#        with a FutureWarning, until 5.40 / 6.0).
# 5.19-5.23: `past_key_values=`.
CACHE = "cache" if _INSTALLED >= (5, 24) else "past_key_values"


def cache_kwarg(cache) -> dict:
    """{CACHE: cache}: pass a cache to a model forward, generate() or a mask function under the installed name."""
    return {CACHE: cache}


# every keyword a forward has been handed its cache under: `cache` (5.24+), `past_key_values` (before 5.24),
# `layer_past` (GPT-NeoX attention), `cache_params` (Mamba-style mixers)
CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past", "cache_params")


def attention_cache(cache=None, past_key_values=None, layer_past=None):
    """The cache an attention forward was handed, under whichever name the caller used: `cache` (5.24+),
    `past_key_values` (before 5.24) or `layer_past` (GPT-NeoX); None when it got none."""
    return next((c for c in (cache, past_key_values, layer_past) if c is not None), None)


def get_cache(mapping):
    """The cache in generate()'s model_kwargs or a model's output (None when it has none)."""
    return mapping.get(CACHE)


# -- constructor signatures -------------------------------------------------------------------------------------
# 5.25+: transformers depends on the `kernels` package, whose @use_kernelized_func replaces a stock attention
#        class's __init__ by `new_init(self, *args, **kwargs)` closing over the original (no __wrapped__).
# 5.19-5.24: __init__ is the class's own.
def constructor_signature(cls: type) -> inspect.Signature:
    """The signature of `cls.__init__` as the class defines it (self, config, layer_idx, ...)."""
    init = cls.__init__
    while "orig_init" in getattr(getattr(init, "__code__", None), "co_freevars", ()):
        init = init.__closure__[init.__code__.co_freevars.index("orig_init")].cell_contents
    return inspect.signature(init)


# -- a hybrid Cache's placeholder at layers without a state -----------------------------------------------------
# 5.23+: DummyLayer (holds nothing).
# 5.19-5.22: an empty LinearAttentionLayer, what transformers itself puts at a hybrid model's mlp / moe layers.
def placeholder_cache_layer():
    """A cache layer for a position of a Cache that the model never reads or writes."""
    if _INSTALLED >= (5, 23):
        from transformers.cache_utils import DummyLayer

        return DummyLayer()
    from transformers.cache_utils import LinearAttentionLayer

    return LinearAttentionLayer()


# -- generate(cache=...) -----------------------------------------------------------------------------------------
# 5.19-5.23: generate() knows only `past_key_values=`: the patch's generate() takes `cache=` too (renamed), so one
#            call works on every supported minor.
# 5.24+: generate() takes `cache=` itself; no row.
def generate_accepting_cache(original):
    def generate(self, *args, **kwargs):
        if "cache" in kwargs:
            if kwargs.get("past_key_values") is not None:
                raise ValueError("generate(): pass the cache as cache= or past_key_values=, not both")
            kwargs["past_key_values"] = kwargs.pop("cache")
        return original(self, *args, **kwargs)

    return functools.update_wrapper(generate, original, assigned=("__name__", "__qualname__", "__doc__"))


def patch_rows() -> list[tuple]:
    """(owner, name, make, why) rows of the patch table (_patching.py) that only some minors need."""
    from transformers.generation.utils import GenerationMixin

    rows = []
    if CACHE == "past_key_values":
        rows.append(
            (
                GenerationMixin,
                "generate",
                generate_accepting_cache,
                "generate(cache=...) on minors whose generate() knows only past_key_values= (compat.py)",
            )
        )
    return rows
