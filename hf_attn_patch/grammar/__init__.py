"""Grammar-constrained decoding (JSON Schema, regex, Lark/GBNF, choices) as logits processors for generate().

Backends: llguidance (default) and xgrammar, imported lazily. See processors.py for the per-row synchronisation
contract (speculative decoding, beam search) and state.py for the generate()-independent GrammarState.
JSON Schema keywords llguidance refuses (not, if / then / else, dependencies, oneOf exclusivity, uniqueItems,
contains, unknown formats, ...) are widened for the grammar (schema_relax.py) and checked exactly with jsonschema
where the sub-value they govern closes (schema_checks.py); a row whose check failed is rolled back and decoded again
by one policy on every path: generate(), speculative decoding and the engine (retry.py).
"""

from .compiler import CompiledGrammar, compile_grammar
from .errors import BackendUnavailableError, GrammarError
from .generate_kwargs import processor_from_generate_kwargs
from .processors import (
    ChoiceLogitsProcessor,
    GrammarConstrainedLogitsProcessor,
    GrammarLogitsProcessor,
    JSONSchemaLogitsProcessor,
    RegexLogitsProcessor,
)
from .spec import GrammarSpec
from .state import GrammarState
from .vocab import get_adapter, token_bytes

__all__ = [
    "BackendUnavailableError",
    "ChoiceLogitsProcessor",
    "CompiledGrammar",
    "GrammarConstrainedLogitsProcessor",
    "GrammarError",
    "GrammarLogitsProcessor",
    "GrammarSpec",
    "GrammarState",
    "JSONSchemaLogitsProcessor",
    "RegexLogitsProcessor",
    "compile_grammar",
    "get_adapter",
    "processor_from_generate_kwargs",
    "token_bytes",
]
