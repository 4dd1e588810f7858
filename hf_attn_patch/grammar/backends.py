"""The grammar engines behind the processors: llguidance and xgrammar, behind one small matcher interface.

Both packages are imported lazily (on first compile). ``backend="auto"`` picks llguidance, then xgrammar; a backend
named explicitly that cannot be imported raises :class:`BackendUnavailableError`.

Matcher contract (what :class:`~hf_attn_patch.grammar.state.GrammarState` relies on): ``consume`` never leaves the
matcher in an error state (it consumes the longest accepted prefix and reports its length); EOS ids are never
passed to a matcher (the state handles EOS itself).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Protocol

import torch

from .errors import BackendUnavailableError, GrammarError
from .schema_relax import walk
from .spec import GrammarSpec
from .vocab import TokenizerAdapter

logger = logging.getLogger(__name__)

BACKENDS = ("llguidance", "xgrammar")
INSTALL = {
    "llguidance": "pip install llguidance, a dependency of hf-attn-patch",
    "xgrammar": "pip install 'hf-attn-patch[grammar]'",
}


class Matcher(Protocol):
    retryable: bool  # True: a failed exact check can be retried (retry_point(), restart(): checked_matcher.py)

    def consume(self, tokens: list[int]) -> int: ...
    def validate(self, tokens: list[int]) -> int: ...
    def rollback(self, n: int) -> None: ...
    def fill(self, bitmask: torch.Tensor, index: int) -> None: ...
    def is_accepting(self) -> bool: ...
    def is_stopped(self) -> bool: ...
    def error(self) -> str | None: ...
    def forced_tokens(self) -> list[int]: ...
    def clone(self) -> "Matcher": ...


def resolve_backend(name: str) -> "LLGuidanceBackend | XGrammarBackend":
    """The backend object for `name` ("auto" | "llguidance" | "xgrammar")."""
    if name not in ("auto",) + BACKENDS:
        raise GrammarError(f"backend: expected 'auto', 'llguidance' or 'xgrammar', got {name!r}")
    candidates = BACKENDS if name == "auto" else (name,)
    errors = []
    for cand in candidates:
        try:
            return _BACKEND_CLASSES[cand]()
        except ImportError as err:
            errors.append(f"{cand}: {err}")
            if name != "auto":
                raise BackendUnavailableError(
                    f"backend={name!r} was requested but cannot be imported ({err}); "
                    f"install it ({INSTALL[name]}) or use backend='auto'"
                ) from err
            logger.info("grammar backend %s unavailable (%s), trying the next one", cand, err)
    raise BackendUnavailableError(
        "no grammar backend can be imported: reinstall hf-attn-patch, which depends on "
        "llguidance (pip install llguidance); " + "; ".join(errors)
    )


# ----------------------------------------------------------------------------------------------- JSON Schema checks
# Keywords xgrammar 0.2.9 compiles without error but does not enforce (output may violate the schema) or turns into
# an unsatisfiable grammar; checked by compiling each and matching a violating / a valid instance.
_XGRAMMAR_UNSUPPORTED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "oneOf",
)


def _check_xgrammar_schema(schema: dict) -> None:
    for path, sub in walk(schema):
        for key in _XGRAMMAR_UNSUPPORTED:
            if key in sub:
                raise GrammarError(
                    f"JSON Schema feature {key!r} (at {path}) is not supported by the xgrammar backend; "
                    "use backend='llguidance' or remove it"
                )
        if isinstance(sub.get("allOf"), list) and len(sub["allOf"]) > 1:
            raise GrammarError(
                f"JSON Schema feature 'allOf' with {len(sub['allOf'])} subschemas (at {path}) is not supported by the "
                "xgrammar backend; use backend='llguidance' or merge the subschemas"
            )


def tagged_json_lark(schema: dict, open_tag: str, close_tag: str, options: dict) -> str:
    """Lark text of a tagged_json spec (spec.py): free text whose first character is not the open tag's, or
    open tag + %json (its JSON options as the schema's "x-guidance") + close tag."""
    first = re.escape(open_tag[0]).replace("/", "\\/")
    schema = {**schema, "x-guidance": options} if isinstance(schema, dict) else schema
    return (
        f"start: TEXT | {json.dumps(open_tag)} call {json.dumps(close_tag)}\nTEXT: /[^{first}](.|\\n)*/\n"
        f"call: %json {json.dumps(schema, ensure_ascii=False)}\n"
    )


# ------------------------------------------------------------------------------------------------------ llguidance
class LLGuidanceBackend:
    """llguidance: Earley parser + lexer; fast compile, broad JSON Schema coverage, explicit errors."""

    name = "llguidance"

    def __init__(self):
        import llguidance  # noqa: F401  (ImportError = unavailable)

        self._llg = llguidance

    def compile(
        self,
        spec: GrammarSpec,
        adapter: TokenizerAdapter,
        *,
        separators=(", ", ": "),
        whitespace_flexible: bool = False,
        json_options: dict | None = None,
    ):
        """Template matcher for `spec`; GrammarError on an unsupported feature or syntax error.
        json_options: extra llguidance JSON options (``coerce_one_of``, ``lenient``)."""
        llg = self._llg
        if whitespace_flexible:  # any whitespace around the bare separators (", " would require the space)
            separators = tuple(sep.strip() for sep in separators)
        options = {
            "whitespace_flexible": whitespace_flexible,
            "item_separator": separators[0],
            "key_separator": separators[1],
            **(json_options or {}),
        }
        try:
            if spec.kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.source, overrides=options)
            elif spec.kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
            elif spec.kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.source)
            elif spec.kind == "lark":
                grammar = llg.LLMatcher.grammar_from_lark(spec.source)
            elif spec.kind == "gbnf":
                grammar = llg.grammar_from("gbnf", spec.source)
            elif spec.kind == "choice":
                grammar = llg.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.source)
                )
            elif spec.kind == "tagged_json":
                grammar = llg.LLMatcher.grammar_from_lark(tagged_json_lark(*spec.source, options))
            else:
                raise GrammarError(f"kind: unknown grammar kind {spec.kind!r}")
        except ValueError as err:
            if isinstance(err, GrammarError):
                raise
            raise GrammarError(f"{spec.kind}: {err}") from None
        tokenizer = adapter.llguidance_tokenizer()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError(f"{spec.kind} not supported by llguidance: {'; '.join(messages)}")
        for msg in messages:
            if (json_options or {}).get("coerce_one_of") and "falling back to anyOf" in msg:
                continue  # asked for: oneOf exclusivity is checked exactly (schema_checks.py)
            logger.warning("llguidance: %s", msg)
        template = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"{spec.kind} not supported by llguidance: {template.get_error()}")
        return template

    def matcher(self, compiled) -> "_LLGMatcher":
        return _LLGMatcher(compiled.deep_copy())


class _LLGMatcher:
    retryable = False

    def __init__(self, m):
        self.m = m

    def consume(self, tokens):
        if not tokens:
            return 0
        n = self.m.validate_tokens(tokens)
        if n and not self.m.consume_tokens(tokens[:n]):
            raise RuntimeError(f"llguidance rejected tokens it had validated: {self.m.get_error()}")
        return n

    def validate(self, tokens):
        return self.m.validate_tokens(tokens) if tokens else 0

    def rollback(self, n):
        if n and not self.m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self.m.get_error()}")

    def fill(self, bitmask, index):
        row = bitmask[index]
        self.m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def is_accepting(self):
        return self.m.is_accepting()

    def is_stopped(self):
        return self.m.is_stopped()

    def error(self):
        return self.m.get_error() if self.m.is_error() else None

    def forced_tokens(self):
        return list(self.m.compute_ff_tokens())

    def clone(self):
        return _LLGMatcher(self.m.deep_copy())


# -------------------------------------------------------------------------------------------------------- xgrammar
class XGrammarBackend:
    """xgrammar: pushdown automaton with precomputed token masks; slower compile, strict JSON defaults."""

    name = "xgrammar"

    def __init__(self):
        import xgrammar  # noqa: F401

        self._xgr = xgrammar

    def compile(
        self,
        spec: GrammarSpec,
        adapter: TokenizerAdapter,
        *,
        separators=(", ", ": "),
        whitespace_flexible: bool = False,
        json_options: dict | None = None,
    ):
        """json_options: llguidance's; none apply here. A JSON Schema reaches us widened (schema_relax.py): the
        keyword check below is the guard that nothing xgrammar would not enforce gets through unchecked."""
        xgr = self._xgr
        compiler = adapter.xgrammar_compiler()
        try:
            if spec.kind == "json_schema":
                _check_xgrammar_schema(spec.source)
                return compiler.compile_json_schema(
                    spec.source, any_whitespace=whitespace_flexible, separators=tuple(separators), strict_mode=True
                )
            if spec.kind == "tagged_json":  # text, or open tag + the schema's JSON + close tag
                schema, open_tag, close_tag = spec.source
                _check_xgrammar_schema(schema)
                first = "\\" + open_tag[0] if open_tag[0] in "\\]^-" else open_tag[0]
                body = xgr.Grammar.from_json_schema(
                    json.dumps(schema),
                    any_whitespace=whitespace_flexible,
                    separators=tuple(separators),
                    strict_mode=True,
                )
                call = xgr.Grammar.concat(
                    xgr.Grammar.from_ebnf(f"root ::= {json.dumps(open_tag)}"),
                    body,
                    xgr.Grammar.from_ebnf(f"root ::= {json.dumps(close_tag)}"),
                )
                text = xgr.Grammar.from_ebnf(f"root ::= [^{first}] [^\\0]*")
                return compiler.compile_grammar(xgr.Grammar.union(text, call))
            if spec.kind == "json_object":
                return compiler.compile_json_schema(
                    {"type": "object"},
                    any_whitespace=whitespace_flexible,
                    separators=tuple(separators),
                    strict_mode=False,
                )
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "lark":
                return compiler.compile_lark(spec.source)
            if spec.kind == "gbnf":
                return compiler.compile_grammar(xgr.Grammar.from_ebnf(spec.source))
            if spec.kind == "choice":
                ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.source)
                return compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
        except GrammarError:
            raise
        except Exception as err:  # noqa: BLE001  (xgrammar raises RuntimeError / its own types for bad grammars)
            raise GrammarError(f"{spec.kind} not supported by xgrammar: {err}") from None
        raise GrammarError(f"kind: unknown grammar kind {spec.kind!r}")

    def matcher(self, compiled) -> "_XGRMatcher":
        return _XGRMatcher(self._xgr.GrammarMatcher(compiled, terminate_without_stop_token=False))


class _XGRMatcher:
    retryable = False

    def __init__(self, m):
        self.m = m

    def consume(self, tokens):
        n = 0
        for t in tokens:  # accept_token leaves the state unchanged on a rejected token
            if not self.m.accept_token(int(t)):
                break
            n += 1
        return n

    def validate(self, tokens):
        n = self.consume(tokens)
        if n:
            self.m.rollback(n)
        return n

    def rollback(self, n):
        if n:
            self.m.rollback(n)

    def fill(self, bitmask, index):
        self.m.fill_next_token_bitmask(bitmask, index)

    def is_accepting(self):
        return self.m.is_completed()

    def is_stopped(self):
        return self.m.is_terminated()

    def error(self):
        return None

    def forced_tokens(self):
        return list(self.m.find_jump_forward_tokens())

    def clone(self):
        return _XGRMatcher(self.m.fork())


_BACKEND_CLASSES = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}
