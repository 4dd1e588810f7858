"""What the patch puts in GenerationMixin for speculative decoding (installed by _patching.py, which restores the
originals):

- `assisted_decoding_any_batch(original)`: `_assisted_decoding` runs our loop (decoding.py) for every batch size;
  transformers' own still runs what ours does not cover (different tokenizers, MTP, output_scores...) at batch 1,
  and batch > 1 with those is refused naming the option.
- `generate_with_speculative_options(original)`: `generate` takes our keywords off the call (generate() rejects
  keywords the model does not know): `speculative_stats=` and `draft_length=` reach the loop through
  decoding.generate_options.
"""

from __future__ import annotations

import functools

from .decoding import generate_options, speculative_decoding, unsupported_reason

GENERATE_KEYWORDS = ("speculative_stats", "draft_length")


def assisted_decoding_any_batch(original):
    def _assisted_decoding(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        inputs_tensor=None,
        assistant_model=None,
        assistant_tokenizer=None,
        tokenizer=None,
        **model_kwargs,
    ):
        batch = input_ids.shape[0]
        reason = unsupported_reason(generation_config, model_kwargs, assistant_tokenizer, streamer, batch)
        if reason is None and synced_gpus:
            reason = "synced_gpus"
        if reason is None and self.config.is_encoder_decoder:
            reason = "encoder-decoder models"
        if reason is None:
            return speculative_decoding(
                self,
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                streamer=streamer,
                assistant_model=assistant_model,
                **model_kwargs,
            )
        if batch > 1:
            raise ValueError(f"speculative decoding with batch_size={batch} does not support {reason}")
        return original(
            self,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            synced_gpus,
            streamer,
            inputs_tensor,
            assistant_model,
            assistant_tokenizer,
            tokenizer,
            **model_kwargs,
        )

    _assisted_decoding.__wrapped__ = original
    return _assisted_decoding


def generate_with_speculative_options(original):
    def generate(self, *args, **kwargs):
        token = generate_options.set({name: kwargs.pop(name) for name in GENERATE_KEYWORDS if name in kwargs})
        try:
            return original(self, *args, **kwargs)
        finally:
            generate_options.reset(token)

    # name, docstring and signature (through __wrapped__) of the original; __module__ stays ours
    return functools.update_wrapper(generate, original, assigned=("__name__", "__qualname__", "__doc__"))
