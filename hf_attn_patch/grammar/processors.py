"""Grammar-constrained decoding as transformers LogitsProcessors.

One :class:`GrammarState` per row. Every call re-synchronises the states from ``input_ids`` (the contract speculative
decoding relies on): for each row, the generated suffix ``input_ids[row, prompt_len:]`` (cut after its first EOS) is
compared with the tokens the state has consumed; the state rolls back to the common prefix and accepts the new
tokens. A row whose suffix changed completely (beam reordering) starts from a clone of the old row that shares the
longest prefix with it. ``prompt_len`` is the sequence length at the first call; a call whose first ``prompt_len``
columns differ from that prompt (or with another batch size) starts over, so one processor can serve several
generate() calls (:meth:`reset` does it explicitly).

Then the rows' BatchMatcher (matcher.py: the masks, the bitmask op and the dead-end policy shared with speculative
decoding and the engine) fills one CPU bitmask and applies it in place on ``scores``; a dead end's reason is in
``finish_reasons[row]``.
"""

from __future__ import annotations

import logging
import re

import torch
from transformers import LogitsProcessor

from .compiler import CompiledGrammar, compile_grammar
from .errors import GrammarError
from .matcher import BatchMatcher
from .spec import DEFAULT_PROPERTY_ORDER, GrammarSpec
from .state import GrammarState

logger = logging.getLogger(__name__)

_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # first index where they differ, by bisection on slice equality (C-speed compares)
    while lo < hi:
        mid = (lo + hi) // 2
        if a[: mid + 1] == b[: mid + 1]:
            lo = mid + 1
        else:
            hi = mid
    return lo


class GrammarConstrainedLogitsProcessor(LogitsProcessor):
    """Constrain each row to a grammar. Subclasses build the specs from schemas / regexes / grammar text / choices.

    specs: one GrammarSpec for every row, or a list with one per input row (expanded to beams /
        num_return_sequences: row r uses specs[r // (batch // len(specs))]).
    tokenizer: the model's Hugging Face tokenizer. backend: "auto" | "llguidance" | "xgrammar".
    eos_token_id: int or list (default: the tokenizer's); must match the generation config's EOS so rows stop.
    separators / whitespace_flexible: JSON formatting, see :func:`compile_grammar`.

    After generation: ``finish_reasons[row]`` is None (still running or cut by length), "eos" (grammar complete), or
    "dead_end: ..."; ``calls`` counts __call__s; ``states`` are the per-row GrammarStates.
    """

    def __init__(
        self,
        specs,
        tokenizer,
        *,
        backend: str = "auto",
        eos_token_id=None,
        separators=(", ", ": "),
        whitespace_flexible: bool = False,
    ):
        specs = [specs] if isinstance(specs, GrammarSpec) else list(specs)
        if not specs or not all(isinstance(s, GrammarSpec) for s in specs):
            raise GrammarError(f"specs: expected a GrammarSpec or a non-empty list of them, got {specs!r:.100}")
        # Compile now: unsupported features raise here, before generation.
        self.grammars: list[CompiledGrammar] = [
            compile_grammar(
                s,
                tokenizer,
                backend=backend,
                eos_token_id=eos_token_id,
                separators=separators,
                whitespace_flexible=whitespace_flexible,
            )
            for s in specs
        ]
        self.eos_token_ids = self.grammars[0].adapter.eos_token_ids
        self.vocab_size = self.grammars[0].adapter.vocab_size
        self.backend = self.grammars[0].backend_name
        self.calls = 0
        self.reset()

    def reset(self) -> None:
        """Forget all rows: the next call fixes a new prompt length and batch size."""
        self.prompt_len: int | None = None
        self.matcher = BatchMatcher([])
        self._bitmask: torch.Tensor | None = None
        self._resume: tuple[int, dict, str | None] = (0, {}, None)

    def resume(self, grammar_tokens: int, forbid: dict, reason: str | None = None) -> None:
        """The next call's last `grammar_tokens` input columns are grammar output already (a retry after a rolled
        back check failure), and `forbid` ({text: token ids}) are continuations to mask (checked grammars only)."""
        self.reset()
        self._resume = (grammar_tokens, forbid, reason)

    @property
    def states(self) -> list[GrammarState]:
        return self.matcher.states

    @property
    def finish_reasons(self) -> list[str | None]:
        return [self.matcher.finish_reason(r) for r in range(len(self.matcher))]

    # ------------------------------------------------------------------ rows
    def _start(self, input_ids: torch.LongTensor) -> None:
        batch = input_ids.shape[0]
        n = len(self.grammars)
        if batch % n:
            raise ValueError(f"specs: {n} grammars (one per input row) do not divide the batch of {batch} rows")
        per = batch // n
        self.prompt_len = input_ids.shape[1] - self._resume[0]
        self._prompt = input_ids[:, : self.prompt_len].clone()
        self.matcher = BatchMatcher([self.grammars[r // per].new_state() for r in range(batch)])
        for state in self.matcher.states:
            if self._resume[1] and hasattr(state._m, "restart"):
                state._m.restart({k: set(v) for k, v in self._resume[1].items()}, self._resume[2])
        self._bitmask = self.matcher.allocate_bitmask()

    def _same_request(self, ids: torch.Tensor) -> bool:
        """Whether `ids` continues the prompt seen at the first call (else generate() reuses us for a new request)."""
        return (
            ids.shape[0] == self._prompt.shape[0]
            and ids.shape[1] >= self.prompt_len
            and torch.equal(ids[:, : self.prompt_len], self._prompt)
        )

    def _targets(self, input_ids: torch.LongTensor) -> list[list[int]]:
        rows = input_ids[:, self.prompt_len :].tolist()
        eos = self.eos_token_ids
        out = []
        for seq in rows:
            cut = min((seq.index(e) for e in eos if e in seq), default=None)
            out.append(seq if cut is None else seq[: cut + 1])
        return out

    def _sync(self, targets: list[list[int]]) -> None:
        """Bring every state to its row's target tokens: roll back what diverged, accept what is new."""
        old = self.matcher.states
        prefix = [_common_prefix(s.tokens, t) for s, t in zip(old, targets)]
        source = list(range(len(old)))
        for r, (s, t) in enumerate(zip(old, targets)):
            if prefix[r] < len(s.tokens):  # diverged (beam reordering, rejected drafts): find the best old row
                for j, o in enumerate(old):
                    if j != r and len(o.tokens) > prefix[r]:
                        p = _common_prefix(o.tokens, t)
                        if p > prefix[r]:  # a clone + short rollback beats re-advancing over the difference
                            source[r], prefix[r] = j, p
        # Clone from the untouched old states first, then mutate.
        self.matcher = BatchMatcher([old[r] if source[r] == r else old[source[r]].clone() for r in range(len(old))])
        for r, (s, t) in enumerate(zip(self.matcher.states, targets)):
            self.matcher.rollback(r, len(s.tokens) - prefix[r])
            if len(t) == prefix[r]:
                self.matcher.clear_dead(r)  # the rejected token is gone (a "no token allowed" end is found again)
            self.matcher.accept_tokens(r, t[prefix[r] :])  # a rejected token: a dead end (only EOS follows)

    # ------------------------------------------------------------------ call
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids [B, T], scores [B, V] (any device): returns scores with disallowed tokens at -inf (in place)."""
        self.calls += 1
        ids = input_ids.cpu()
        if self.prompt_len is not None and not self._same_request(ids):
            logger.debug("grammar processor: new prompt or batch size, starting over")
            self.reset()
        if self.prompt_len is None:
            self._start(ids)
        self._sync(self._targets(ids))
        self.matcher.fill_bitmask(self._bitmask, width=scores.shape[-1])
        return self.matcher.apply(scores, self._bitmask)

    # ------------------------------------------------------------------ helpers for callers
    def forced_tokens(self, row: int) -> list[int]:
        """Tokens the grammar forces next for `row` (fast-forward), after the last call's synchronisation."""
        return self.matcher.forced_tokens(row)

    def validate_tokens(self, row: int, token_ids) -> int:
        """How many leading `token_ids` row `row`'s grammar accepts after its current tokens (draft checking)."""
        return self.matcher.validate_tokens(row, token_ids)


def _per_row(value, is_single) -> list:
    """A single value, or a list with one value per input row."""
    if is_single(value):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(is_single(v) for v in value):
        return list(value)
    return None


class JSONSchemaLogitsProcessor(GrammarConstrainedLogitsProcessor):
    """Rows produce JSON valid under `schema` (dict or JSON text), or a list with one schema per input row;
    property_order: "any" (default) or "schema" (GrammarSpec.json_schema)."""

    def __init__(
        self, schema, tokenizer, backend: str = "auto", property_order: str = DEFAULT_PROPERTY_ORDER, **kwargs
    ):
        schemas = _per_row(schema, lambda v: isinstance(v, (dict, str, bool)))
        if schemas is None:
            raise GrammarError(
                f"schema: expected a JSON Schema (dict or JSON text) or a list of them, got {schema!r:.100}"
            )
        super().__init__(
            [GrammarSpec.json_schema(s, property_order) for s in schemas], tokenizer, backend=backend, **kwargs
        )


class RegexLogitsProcessor(GrammarConstrainedLogitsProcessor):
    """Rows produce text fully matching `pattern` (a regex string), or a list with one pattern per input row."""

    def __init__(self, pattern, tokenizer, backend: str = "auto", **kwargs):
        patterns = _per_row(pattern, lambda v: isinstance(v, str))
        if patterns is None:
            raise GrammarError(f"pattern: expected a regex string or a list of them, got {pattern!r:.100}")
        super().__init__([GrammarSpec.regex(p) for p in patterns], tokenizer, backend=backend, **kwargs)


def grammar_spec(text: str, syntax: str = "auto") -> GrammarSpec:
    """GrammarSpec for grammar text: syntax "lark", "gbnf" (GBNF / EBNF, ``root ::= ...``) or "auto" (``::=`` ->
    gbnf)."""
    if syntax not in ("auto", "lark", "gbnf", "ebnf"):
        raise GrammarError(f"syntax: expected 'auto', 'lark', 'gbnf' or 'ebnf', got {syntax!r}")
    if not isinstance(text, str):
        raise GrammarError(f"grammar: expected grammar text, got {type(text).__name__}")
    if syntax == "auto":
        syntax = "gbnf" if _GBNF_RULE.search(text) else "lark"
    return GrammarSpec.lark(text) if syntax == "lark" else GrammarSpec.gbnf(text)


class GrammarLogitsProcessor(GrammarConstrainedLogitsProcessor):
    """Rows follow a context-free grammar: Lark text (``start: ...``) or GBNF / EBNF text (``root ::= ...``).

    grammar: text, or a list with one text per input row. syntax: "auto" | "lark" | "gbnf".
    """

    def __init__(self, grammar, tokenizer, backend: str = "auto", syntax: str = "auto", **kwargs):
        texts = _per_row(grammar, lambda v: isinstance(v, str))
        if texts is None:
            raise GrammarError(f"grammar: expected grammar text or a list of them, got {grammar!r:.100}")
        super().__init__([grammar_spec(t, syntax) for t in texts], tokenizer, backend=backend, **kwargs)


class ChoiceLogitsProcessor(GrammarConstrainedLogitsProcessor):
    """Rows produce exactly one of `choices` (a list of strings), or a list with one choice list per input row."""

    def __init__(self, choices, tokenizer, backend: str = "auto", **kwargs):
        if isinstance(choices, (list, tuple)) and choices and all(isinstance(c, (list, tuple)) for c in choices):
            per_row = list(choices)
        else:
            per_row = [choices]
        super().__init__([GrammarSpec.choice(c) for c in per_row], tokenizer, backend=backend, **kwargs)
