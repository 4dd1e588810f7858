"""Speculative (assisted) decoding in generate() for any batch size, with exact rejection sampling.

`model.generate(..., assistant_model=small)`, `assistant_early_exit=n` or `prompt_lookup_num_tokens=k` run our
loop (decoding.py) for every batch size while the patch is installed.
"""

from .decoding import SpeculativeStats, speculative_decoding
from .drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from .rejection import verify_greedy, verify_sampling

__all__ = [
    "SpeculativeStats",
    "speculative_decoding",
    "Draft",
    "Drafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "verify_greedy",
    "verify_sampling",
]
