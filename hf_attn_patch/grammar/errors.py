"""Errors raised by the grammar package."""

from __future__ import annotations


class GrammarError(ValueError):
    """A grammar, schema or regex cannot be used: unsupported feature, syntax error, or bad argument.

    Raised at construction, before any generation work; the message names the feature or field.
    """


class BackendUnavailableError(ImportError):
    """An explicitly requested grammar backend (``llguidance`` / ``xgrammar``) is not installed or failed to load."""
