"""generate(response_format=..., grammar=..., tokenizer=..., grammar_backend=...): the patch's wrapper of
GenerationMixin.generate for grammar keywords (installed by _patching.py, which restores the original).
generate() rejects keywords the model does not know, and has no hook for extra ones: the wrapper takes ours off the
call, compiles the grammar at once (errors before any work) and appends its processor to `logits_processor`; rows
whose exact JSON Schema check failed are rolled back and decoded again after the call (retry.py). The output (a
tensor, or generate()'s dict output) carries ``finish_reasons``: per row "eos", "length" or "check_failed: ...".
"""

from __future__ import annotations

import functools

import torch
from transformers import LogitsProcessorList

from .generate_kwargs import processor_from_generate_kwargs
from .retry import retry_failed_rows, row_finish_reasons

GRAMMAR_KEYWORDS = ("response_format", "grammar", "grammar_backend")


def generate_with_grammar(original):
    def generate(self, *args, **kwargs):
        processor = None
        if kwargs.get("response_format") is not None or kwargs.get("grammar") is not None:
            processor = add_grammar_processor(self, kwargs)
        for name in GRAMMAR_KEYWORDS:
            kwargs.pop(name, None)
        out = original(self, *args, **kwargs)
        if processor is not None:  # rows whose JSON Schema check failed: rolled back and decoded again
            out, reasons = retry_failed_rows(self, original, processor, out, args, kwargs)
            ids = out if torch.is_tensor(out) else getattr(out, "sequences", None)
            if ids is not None and processor.prompt_len is not None:
                # each row's finish reason: "eos", "length", or "check_failed: <keyword> at <schema path>"
                out.finish_reasons = row_finish_reasons(
                    ids, processor.prompt_len, set(processor.eos_token_ids), reasons
                )
        return out

    # name, docstring and signature (through __wrapped__) of the original; __module__ stays ours
    return functools.update_wrapper(generate, original, assigned=("__name__", "__qualname__", "__doc__"))


def add_grammar_processor(model, kwargs: dict):
    """Compile generate()'s grammar keywords in `kwargs` into a processor appended to kwargs["logits_processor"]
    (returned; None when unconstrained)."""
    eos = kwargs.get("eos_token_id")
    if eos is None and model.generation_config is not None:
        eos = model.generation_config.eos_token_id
    processor = processor_from_generate_kwargs(
        response_format=kwargs.get("response_format"),
        grammar=kwargs.get("grammar"),
        tokenizer=kwargs.get("tokenizer"),
        backend=kwargs.get("grammar_backend", "auto"),
        eos_token_id=eos,
    )
    if processor is not None:
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), processor])
    return processor
