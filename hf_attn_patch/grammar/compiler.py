"""Compile a :class:`GrammarSpec` for a tokenizer and backend once; hand out fresh :class:`GrammarState`s from it."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from .backends import resolve_backend
from .errors import GrammarError
from .checked_matcher import CheckedMatcher
from .formats import known_formats
from .schema_checks import check_schema, schema_checks_for
from .schema_relax import relax_and_compile
from .spec import GrammarSpec
from .state import GrammarState
from .vocab import TokenizerAdapter, get_adapter

logger = logging.getLogger(__name__)

_CACHE: "OrderedDict[tuple, CompiledGrammar]" = OrderedDict()
_CACHE_SIZE = 128
_LOCK = threading.Lock()


class CompiledGrammar:
    """A grammar compiled for one tokenizer by one backend; immutable, shareable between rows and requests.

    new_state() -> GrammarState at the start of the grammar. compile_seconds: time the backend took.
    checks: the exact JSON Schema checks on top of a widened grammar (schema_checks.SchemaChecks), or None when the
    backend compiled the schema as it is. widened: {keyword: [schema paths]} the grammar does not enforce itself.
    notes: remarks for the user (unknown formats, accepted as any string).
    """

    @property
    def notes(self) -> tuple:
        return self.checks.notes if self.checks is not None else ()

    def __init__(
        self,
        spec: GrammarSpec,
        backend,
        adapter: TokenizerAdapter,
        compiled,
        compile_seconds: float,
        checks=None,
        widened=None,
        banned=(),
    ):
        self.spec = spec
        self.backend = backend
        self.adapter = adapter
        self._compiled = compiled
        self.compile_seconds = compile_seconds
        self.checks = checks
        self.widened = widened
        self.banned = tuple(adapter.special_token_ids) + tuple(banned)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def new_state(self) -> GrammarState:
        matcher = self.backend.matcher(self._compiled)
        if self.checks is not None:
            matcher = CheckedMatcher(matcher, self.checks)
        return GrammarState(
            matcher,
            self.adapter.eos_token_ids,
            self.adapter.vocab_size,
            backend=self.backend.name,
            banned_token_ids=self.banned,
        )


def compile_grammar(
    spec: GrammarSpec,
    tokenizer,
    *,
    backend: str = "auto",
    eos_token_id=None,
    separators=(", ", ": "),
    whitespace_flexible: bool = False,
    cache: bool = True,
) -> CompiledGrammar:
    """Compile `spec` for `tokenizer` (cached by backend, vocabulary, EOS ids, spec and options).

    separators / whitespace_flexible apply to JSON: (item, key) separators, and whether free whitespace is allowed
    between tokens (off by default: small models otherwise emit whitespace forever).
    Raises GrammarError (unsupported feature, syntax error) or BackendUnavailableError, before any generation.
    """
    if not isinstance(spec, GrammarSpec):
        raise GrammarError(f"spec: expected a GrammarSpec, got {type(spec).__name__}")
    if (
        not isinstance(separators, (tuple, list))
        or len(separators) != 2
        or not all(isinstance(s, str) and s.strip() in (",", ":") for s in separators)
    ):
        raise GrammarError(f"separators: expected (item, key) like (', ', ': '), got {separators!r}")
    be = resolve_backend(backend)
    adapter = get_adapter(tokenizer, eos_token_id)
    key = (be.name, adapter.fingerprint, adapter.eos_token_ids, spec.key, tuple(separators), bool(whitespace_flexible))
    if cache:
        with _LOCK:
            hit = _CACHE.get(key)
            if hit is not None:
                _CACHE.move_to_end(key)
                return hit
    t0 = time.perf_counter()
    checks = widened = None
    if spec.kind in ("json_schema", "tagged_json"):
        schema, tags = (spec.source, None) if spec.kind == "json_schema" else (spec.source[0], spec.source[1:])

        def compile_fn(relaxed_schema, options):
            source = relaxed_schema if tags is None else (relaxed_schema, *tags)
            return be.compile(
                GrammarSpec(spec.kind, source),
                adapter,
                separators=tuple(separators),
                whitespace_flexible=whitespace_flexible,
                json_options=options,
            )

        check_schema(schema)
        compiled, relaxed = relax_and_compile(schema, compile_fn, known_formats(), be.name, spec.property_order)
        checks = schema_checks_for(schema, relaxed, adapter.token_bytes(), frame=tags)
        widened = relaxed.dropped
        for note in relaxed.notes:
            logger.warning("json_schema: %s", note)
    else:
        compiled = be.compile(spec, adapter, separators=tuple(separators), whitespace_flexible=whitespace_flexible)
    banned = ()
    if be.name == "xgrammar" and spec.kind in ("json_schema", "json_object", "tagged_json"):
        # xgrammar 0.2.9 lets raw control characters into JSON strings (invalid JSON): tokens with them are masked
        keep = b"\t\n\r" if whitespace_flexible or spec.kind == "tagged_json" else b""
        banned = tuple(i for i, t in enumerate(adapter.token_bytes()) if any(b < 0x20 and b not in keep for b in t))
    result = CompiledGrammar(
        spec, be, adapter, compiled, time.perf_counter() - t0, checks=checks, widened=widened, banned=banned
    )
    logger.debug("compiled %s with %s in %.1f ms", spec.kind, be.name, 1e3 * result.compile_seconds)
    if cache:
        with _LOCK:
            _CACHE[key] = result
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return result
