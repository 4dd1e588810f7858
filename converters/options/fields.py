"""The `option()` field declaration every conversion option is made with, the checks that name an option and its
value, and the command-line value parsers (argparse types; range checks stay in the dataclasses, which name the
option)."""

from __future__ import annotations

from dataclasses import field, fields


def option(
    default=None,
    help: str = "",
    *,
    flat: str | None = None,
    choices: tuple | None = None,
    parse=None,
    metavar: str | None = None,
    flag: str | None = None,
    applied=None,
    factory=None,
    targets: tuple[str, ...] | None = None,
):  # noqa: A002
    """A field declared once: its default and, in its metadata, what the command line and the report need.

    flat: the user-facing name (default: the field's); choices: shown by --help and checked by argparse; parse: the
    argparse type (text -> value; range checks stay in the dataclass, which names the option); flag: an explicit
    --flag with a store_true / store_false action for booleans ("--propagate", "--no-regroup"); applied: the default
    filled in when the option applies (healing options: when healing runs); targets: the conversion targets (`to`)
    the option belongs to (None: every one): given for another, it is refused, naming the option and the target."""
    metadata = {
        "help": help,
        "flat": flat,
        "choices": choices,
        "parse": parse,
        "metavar": metavar,
        "flag": flag,
        "applied": applied,
        "targets": targets,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flat_name(section, name: str) -> str:
    """The flat (user-facing) name of a section's field, from its metadata."""
    return next(f.metadata["flat"] or f.name for f in fields(section) if f.name == name)


def fill(options, name: str, value) -> None:
    """Set a default while validating: the options are frozen from then on."""
    object.__setattr__(options, name, value)


def positive_int(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive integer")


def non_negative_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")


def one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


def int_or_auto(text: str) -> int | str:  # a number or the word auto
    return text if text == "auto" else int(text)


def float_or_auto(text: str) -> float | str:
    return text if text == "auto" else float(text)
