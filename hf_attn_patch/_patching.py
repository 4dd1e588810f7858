"""The one place that changes transformers. Every replaced object is recorded so unpatch() puts it back exactly.

What is replaced, and why no official hook does it:
- `<Arch>Attention` in each supported modeling module (see models.architectures.ARCHITECTURES): decoder layers look
  the class up by name when a model is built, so a dispatcher standing under that name gives a model whose config
  carries `attention_variant` our GroupedQueryAttention / MultiHeadLatentAttention, and any other model the stock
  class. transformers has no registry for attention *modules* (AttentionInterface swaps only the kernel).
  DeepSeek-V3 is the one exception: it always gets our MultiHeadLatentAttention (same parameter names and cache
  layout, absorbed decoding over the latent); `with hf_attn_patch.unpatched():` builds the stock one.
- `PreTrainedConfig.__post_init__`: validates `attention_variant` and its fields when a config is built, so a bad
  config.json fails naming the field before any weight is loaded.
- `ALL_CACHE_IMPLEMENTATIONS` (generation/configuration_utils.py) gains "paged_kv", and
  `GenerationMixin._prepare_cache_for_generation` builds a PagedKVCache for it: cache names are a fixed tuple.
- `GenerationMixin._prefill` tells a PagedKVCache where each row's prompt starts (left padding) and which prompt
  blocks it already holds (prefix caching) before the prefill forward; generate() then feeds only the rest.
- `GenerationMixin._assisted_decoding`: our speculative loop (speculative/decoding.py) for every batch size;
  transformers' own still runs what ours does not cover (different tokenizers, MTP, output_scores...) at batch 1.
- `GenerationMixin.generate`: takes our keywords off the call, since generate() rejects keywords the model does not
  know: `response_format=` / `grammar=` (with `tokenizer=`) become a grammar logits processor; `speculative_stats=`
  and `draft_length=` go to the speculative decoding loop.
- Official hooks, recorded the same way: `AttentionInterface.register("paged_kv", ...)` and
  `AttentionMaskInterface.register("paged_kv", sdpa_mask)` (attention that reads the paged blocks itself).
- `AttentionInterface.get_interface`: while a forward context is set on this thread (the engine's runner sets one
  around each step's forward), every lookup returns the paged backend, so the engine never changes the model's
  `config._attn_implementation` (attention/backend.py `interface_in_context`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging

from transformers.configuration_utils import PreTrainedConfig
from transformers.generation import configuration_utils as generation_config_module
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

logger = logging.getLogger(__name__)

# (id(owner), name) -> (owner, name, original object); _ABSENT for registry entries that did not exist
_originals: dict[tuple[int, str], tuple[object, str, object]] = {}
_ABSENT = object()


def _replace(owner, name: str, new) -> None:
    key = (id(owner), name)
    if key not in _originals:
        _originals[key] = (owner, name, vars(owner)[name])
    setattr(owner, name, new)


def _register(mapping: dict, name: str, value) -> None:
    """Add `name` to a registry dict (AttentionInterface's global mapping and its mask twin), restorably."""
    key = (id(mapping), name)
    if key not in _originals:
        _originals[key] = (mapping, name, mapping.get(name, _ABSENT))
    mapping[name] = value


def _restore(owner, name: str, original) -> None:
    if isinstance(owner, dict):
        if original is _ABSENT:
            owner.pop(name, None)
        else:
            owner[name] = original
    else:
        setattr(owner, name, original)


class AttentionDispatch(type):
    """Metaclass of the stand-in put under a stock attention class's name.

    Calling the stand-in builds ours when the config asks for a variant and the stock class otherwise;
    isinstance / issubclass checks against it answer as the stock class would (GPT-2's weight init uses them).
    """

    def __call__(cls, config, *args, **kwargs):
        if getattr(config, "attention_variant", None) is None and not cls.architecture.replaces_stock:
            return cls.original(config, *args, **kwargs)
        bound = cls.signature.bind(None, config, *args, **kwargs).arguments
        if bound.get("is_cross_attention"):  # GPT-2 cross-attention is not self-attention: keep it stock
            return cls.original(config, *args, **kwargs)
        from .models import build_attention

        return build_attention(config, bound.get("layer_idx"))

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.original)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, cls.original)

    def __repr__(cls) -> str:
        return f"<hf_attn_patch dispatch for {cls.original.__module__}.{cls.original.__qualname__}>"


def attention_dispatch(original: type, architecture) -> type:
    """The stand-in for `original` (a stock attention class) of `architecture` (a models.Architecture row)."""
    namespace = {
        "original": original,
        "architecture": architecture,
        "signature": inspect.signature(original.__init__),
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
    }
    return AttentionDispatch(original.__name__, (), namespace)


def _validating_post_init(original):
    def __post_init__(self, **kwargs):
        original(self, **kwargs)
        if getattr(self, "attention_variant", None) is not None:
            from .models import validate_variant_config

            validate_variant_config(self)

    __post_init__.__wrapped__ = original
    return __post_init__


PAGED_CACHE_NAME = "paged_kv"  # "paged" already means transformers' continuous batching


def _prepare_cache_with_paged(original):
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        if generation_config.cache_implementation != PAGED_CACHE_NAME or model_kwargs.get("past_key_values") is not None:
            return original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        from .cache import PagedKVCache

        options = dict(generation_config.cache_config or {})
        block_size = options.get("block_size", 16)
        if "num_blocks" not in options and "max_memory" not in options:  # enough for every row to reach max length
            rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
            options["num_blocks"] = rows * (-(-max_cache_length // block_size) + 1) + 1
        model_kwargs["past_key_values"] = PagedKVCache(self.config.get_text_config(decoder=True), **options)

    _prepare_cache_for_generation.__wrapped__ = original
    return _prepare_cache_for_generation


def _prefill_with_paged(original):
    def _prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=True):
        from .cache import PagedKVCache

        cache = model_kwargs.get("past_key_values")
        if isinstance(cache, PagedKVCache) and is_first_iteration and model_kwargs.get("inputs_embeds") is None:
            cache.start_request(input_ids, model_kwargs.get("attention_mask"))
        return original(self, input_ids, generation_config, model_kwargs, is_first_iteration=is_first_iteration)

    _prefill.__wrapped__ = original
    return _prefill


GENERATE_KEYWORDS = ("speculative_stats", "draft_length")


def _generate_with_options(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        from .speculative.decoding import generate_options

        if kwargs.get("response_format") is not None or kwargs.get("grammar") is not None:
            _add_grammar_processor(self, kwargs)
        kwargs.pop("response_format", None), kwargs.pop("grammar", None)
        token = generate_options.set({name: kwargs.pop(name) for name in GENERATE_KEYWORDS if name in kwargs})
        try:
            return original(self, *args, **kwargs)
        finally:
            generate_options.reset(token)

    return generate


def _add_grammar_processor(model, kwargs) -> None:
    """generate(response_format=..., grammar=..., tokenizer=...): compile now (errors before any work) and append
    the grammar processor to logits_processor."""
    from transformers import LogitsProcessorList

    from .grammar import processor_from_generate_kwargs

    eos = kwargs.get("eos_token_id")
    if eos is None and model.generation_config is not None:
        eos = model.generation_config.eos_token_id
    processor = processor_from_generate_kwargs(response_format=kwargs.get("response_format"),
                                               grammar=kwargs.get("grammar"), tokenizer=kwargs.get("tokenizer"),
                                               backend=kwargs.pop("grammar_backend", "auto"), eos_token_id=eos)  # fmt: skip
    if processor is not None:
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), processor])


def _assisted_any_batch(original):
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                           streamer=None, inputs_tensor=None, assistant_model=None, assistant_tokenizer=None,
                           tokenizer=None, **model_kwargs):  # fmt: skip
        from .speculative.decoding import speculative_decoding, unsupported_reason

        batch = input_ids.shape[0]
        reason = unsupported_reason(generation_config, model_kwargs, assistant_tokenizer, streamer, batch)
        if reason is None and synced_gpus:
            reason = "synced_gpus"
        if reason is None and self.config.is_encoder_decoder:
            reason = "encoder-decoder models"
        if reason is None:
            return speculative_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                        streamer=streamer, assistant_model=assistant_model, **model_kwargs)  # fmt: skip
        if batch > 1:
            raise ValueError(f"speculative decoding with batch_size={batch} does not support {reason}")
        return original(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                        streamer, inputs_tensor, assistant_model, assistant_tokenizer, tokenizer, **model_kwargs)  # fmt: skip

    _assisted_decoding.__wrapped__ = original
    return _assisted_decoding


def patch() -> None:
    """Install the patch (idempotent)."""
    if _originals:
        return
    from .models import ARCHITECTURES

    for arch in ARCHITECTURES.values():
        module = arch.attention_module()
        _replace(module, arch.attention_class, attention_dispatch(getattr(module, arch.attention_class), arch))
    _replace(PreTrainedConfig, "__post_init__", _validating_post_init(vars(PreTrainedConfig)["__post_init__"]))
    names = generation_config_module.ALL_CACHE_IMPLEMENTATIONS
    _replace(generation_config_module, "ALL_CACHE_IMPLEMENTATIONS", names + (PAGED_CACHE_NAME,))
    for name, wrap in (("_prepare_cache_for_generation", _prepare_cache_with_paged), ("_prefill", _prefill_with_paged),
                       ("_assisted_decoding", _assisted_any_batch), ("generate", _generate_with_options)):  # fmt: skip
        _replace(GenerationMixin, name, wrap(vars(GenerationMixin)[name]))
    # The registered attention function over paged memory, and the mask function beside it (without one, padded
    # batches would silently get mask=None).
    from .cache.paged_attention import PAGED_ATTENTION, paged_attention_forward

    _register(AttentionInterface._global_mapping, PAGED_ATTENTION, paged_attention_forward)
    _register(AttentionMaskInterface._global_mapping, PAGED_ATTENTION, sdpa_mask)
    # Inside a forward context (the engine's step) every attention lookup returns the paged backend.
    from .attention.backend import interface_in_context

    _replace(AttentionInterface, "get_interface", interface_in_context(vars(AttentionInterface)["get_interface"]))
    logger.debug("hf_attn_patch: patched %d objects", len(_originals))


def unpatch() -> None:
    """Put every replaced object back (idempotent). Models built while patched keep their modules."""
    for owner, name, original in _originals.values():
        _restore(owner, name, original)
    _originals.clear()


@contextlib.contextmanager
def unpatched():
    """Within the block transformers is stock (e.g. to build a reference model); the patch is restored after."""
    was_patched = is_patched()
    unpatch()
    try:
        yield
    finally:
        if was_patched:
            patch()


def is_patched() -> bool:
    return bool(_originals)


def patched_objects() -> list[tuple[object, str, object]]:
    """(owner, name, original) for everything currently replaced; for tests and debugging."""
    return list(_originals.values())
