"""What a request asks for (SamplingParams) and what it gets back (RequestOutput, TokenLogprob).

Logprobs are of the model's raw next-token distribution: log_softmax of the logits *before* temperature, top-k,
top-p and grammar masks (vLLM's default), so they score the text itself, whatever the sampling settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's limit)


@dataclass
class SamplingParams:
    max_tokens: int = 16  # 0 = prefill only (prompt_logprobs / echo); finish_reason "length"
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request generator: the same seed gives the same tokens whatever the batch
    stop: list[str] = field(default_factory=list)  # stop strings (excluded from the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k: the chosen token's logprob + the k most likely (raw distribution)
    prompt_logprobs: int | None = None  # the same for every prompt token given its prefix (bypasses prefix hits)
    skip_special_tokens: bool = True  # in the returned text
    response_format: dict | None = None  # OpenAI style: {"type": "json_schema", "json_schema": {"schema": ...}}
    grammar: object = None  # anything hf_attn_patch.grammar accepts as `grammar=`
    num_speculative_tokens: int = 0  # n-gram lookup drafts verified per decode step (0 = off)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        _integer("max_tokens", self.max_tokens, 0)
        _real("temperature", self.temperature, 0.0)
        _integer("top_k", self.top_k, 0)
        _real("top_p", self.top_p, 0.0, 1.0, open_low=True)
        if self.seed is not None:
            _integer("seed", self.seed, 0, 2**63 - 1)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"SamplingParams.stop={self.stop!r:.100}: expected a string or a list of non-empty strings"
            )
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids={self.stop_token_ids!r:.100}: expected a list of integers >= 0"
            )
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: expected True or False")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 0, MAX_LOGPROBS, "None or an integer")
        if self.response_format is not None and not isinstance(self.response_format, dict):
            raise ValueError(f"SamplingParams.response_format={self.response_format!r:.100}: expected a dict or None")
        _integer("num_speculative_tokens", self.num_speculative_tokens, 0, 64)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(name: str, value, low: int, high: int | None = None, what: str = "an integer") -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"SamplingParams.{name}={value!r}: expected {what} {bound}")


def _real(name: str, value, low: float, high: float | None = None, open_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and (high is None or value <= high)
    if not ok:
        bound = f"in {'(' if open_low else '['}{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"SamplingParams.{name}={value!r}: expected a finite number {bound}")


@dataclass
class TokenLogprob:
    """One position: the token there, its logprob, and the `top` most likely tokens [(token id, logprob)] there
    (most likely first; k = SamplingParams.logprobs / prompt_logprobs entries)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # generated text so far (stop strings cut off); == decode(prompt + tokens) minus decode(prompt)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS, stop token or string, grammar complete), "length", "abort"
    logprobs: list[TokenLogprob] | None = None  # one per generated token (all so far), when asked for
    new_text: str = ""  # the text added by the step that produced this output (streaming)
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: dict = field(default_factory=dict)  # arrival, first_token, finished (perf_counter seconds)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None), when asked
    token_offsets: list[int] = field(default_factory=list)  # start of each generated token's text in `text`
