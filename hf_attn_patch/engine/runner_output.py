"""What a step computed, as a value: per request id its drawn tokens and logprobs (the runner's answer to a plan).

Nothing here is applied yet: the output processor's update_from_output appends the tokens, cuts them at a stop and
keeps as many logprob entries as tokens it kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .params import TokenLogprob


@dataclass(frozen=True)
class ModelRunnerOutput:
    # per request that drew tokens (it reached its next token and max_tokens > 0), in packing order: its accepted
    # drafts + the next token (1 + accepted tokens)
    sampled: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # per such request that asked for logprobs: one entry per drawn token, of the raw distribution
    logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    # per request scoring prompt tokens: one entry per PromptLogprobRows target, in order
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)
