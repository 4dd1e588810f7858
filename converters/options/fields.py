"""Command-line value parsers of the conversion options (argparse types; the range checks stay in options.py)."""

from __future__ import annotations


def int_or_auto(text: str) -> int | str:  # a number or the word auto
    return text if text == "auto" else int(text)


def float_or_auto(text: str) -> float | str:
    return text if text == "auto" else float(text)
