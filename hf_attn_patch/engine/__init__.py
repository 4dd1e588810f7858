"""Continuous batching with chunked prefill, prefix caching and preemption over paged KV, and an OpenAI server."""

from .core import Engine
from .params import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
