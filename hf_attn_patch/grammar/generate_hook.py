"""generate(response_format=..., grammar=..., tokenizer=..., grammar_backend=...): the patch's wrapper of
GenerationMixin.generate for grammar keywords (installed by _patching.py, which restores the original).
generate() rejects keywords the model does not know, and has no hook for extra ones: the wrapper takes ours off the
call, compiles the grammar at once (errors before any work) and appends its processor to `logits_processor`.
"""

from __future__ import annotations

import functools

from transformers import LogitsProcessorList

from .generate_kwargs import processor_from_generate_kwargs

GRAMMAR_KEYWORDS = ("response_format", "grammar", "grammar_backend")


def generate_with_grammar(original):
    def generate(self, *args, **kwargs):
        if kwargs.get("response_format") is not None or kwargs.get("grammar") is not None:
            add_grammar_processor(self, kwargs)
        for name in GRAMMAR_KEYWORDS:
            kwargs.pop(name, None)
        return original(self, *args, **kwargs)

    # name, docstring and signature (through __wrapped__) of the original; __module__ stays ours
    return functools.update_wrapper(generate, original, assigned=("__name__", "__qualname__", "__doc__"))


def add_grammar_processor(model, kwargs: dict) -> None:
    """Compile generate()'s grammar keywords in `kwargs` into a processor appended to kwargs["logits_processor"]."""
    eos = kwargs.get("eos_token_id")
    if eos is None and model.generation_config is not None:
        eos = model.generation_config.eos_token_id
    processor = processor_from_generate_kwargs(response_format=kwargs.get("response_format"),
                                               grammar=kwargs.get("grammar"), tokenizer=kwargs.get("tokenizer"),
                                               backend=kwargs.get("grammar_backend", "auto"), eos_token_id=eos)  # fmt: skip
    if processor is not None:
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), processor])

