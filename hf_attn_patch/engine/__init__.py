"""Continuous batching with chunked prefill, prefix caching and preemption over paged KV (the OpenAI server on top of
it is hf_attn_patch.serving)."""

from .core import Engine
from .params import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
