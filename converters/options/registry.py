"""The conversion targets, registered by name: the door a new target comes in by.

Each target's module (converters/targets/gqa.py, mla.py, latent_kv.py) ends in `register_target(...)`; the options
read the target list, each target's checks and defaults, its formats and its `--context long` defaults from here.
This module sits below the options (which check `to` against it) and imports nothing of the converter, so the targets,
which stand above the options, can register into it.
"""

from __future__ import annotations

_TARGETS: dict = {}  # name -> the target, in registration order


def register_target(target):
    """Add a ConversionTarget under its name; a second target of the same name is an error."""
    if target.name in _TARGETS and _TARGETS[target.name] is not target:
        raise ValueError(f"conversion target {target.name!r} is registered twice")
    _TARGETS[target.name] = target
    return target


def unregister_target(name: str) -> None:
    """Remove a target (a test's own, once it is done)."""
    _TARGETS.pop(name, None)


def target_names() -> tuple[str, ...]:
    """The registered targets, in registration order ("gqa", "mqa", "mla", "latent_kv")."""
    return tuple(_TARGETS)


def target_of(name: str):
    """The registered target `name`; a ValueError naming it and the choices otherwise."""
    try:
        return _TARGETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"to={name!r} is not one of {target_names()}") from None


def all_formats() -> tuple[str, ...]:
    """Every output format some target writes, in the order the targets declare them ("auto" and "native" first)."""
    return tuple(dict.fromkeys(fmt for target in _TARGETS.values() for fmt in target.formats))


def format_refusal(fmt: str, to: str) -> str:
    """Why `to` cannot write format `fmt`: which targets can, and which formats `to` has."""
    owners = [name for name, target in _TARGETS.items() if fmt in target.formats]
    have = f"to={' / '.join(map(repr, owners))} only" if owners else "no target"
    return f"format={fmt!r} exists for {have}, not to={to!r} (its formats: {', '.join(target_of(to).formats)})"
