"""What a request asks for (SamplingParams) and what it gets back (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (excluded from the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # log-probability of each chosen token (after temperature / top-k / top-p)
    response_format: dict | None = None  # OpenAI style: {"type": "json_schema", "json_schema": {"schema": ...}}
    grammar: object = None  # anything hf_attn_patch.grammar accepts as `grammar=`
    num_speculative_tokens: int = 0  # n-gram lookup drafts verified per decode step (0 = off)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", isinstance(self.temperature, (int, float)) and self.temperature >= 0, "a number >= 0"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0"),
            ("top_p", isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an integer or None"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) for t in self.stop_token_ids), "a list of integers"),
            ("num_speculative_tokens", isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 0,
             "an integer >= 0"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: expected {expected}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # generated text so far (stop strings cut off)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS, stop token or string), "length", "abort", "grammar"
    logprobs: list[float] | None = None
    new_text: str = ""  # the text added by the step that produced this output (streaming)
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    metrics: dict = field(default_factory=dict)  # arrival, first_token, finished (perf_counter seconds)
