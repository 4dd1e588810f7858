"""Optional dependencies: which extra brings which package, and one check that names the extra to install.

    require("serve")            # raises MissingExtraError before any work if fastapi / uvicorn are missing
    available("plot")           # False without matplotlib: the caller skips the plot

Every command checks the extras it needs when its options are validated, never after expensive work.
"""

from __future__ import annotations

import importlib.util

# extra -> the importable modules it provides (pyproject.toml's [project.optional-dependencies])
EXTRAS = {
    "serve": ("fastapi", "uvicorn"),
    "eval": ("lm_eval",),
    "convert": ("datasets",),
    "plot": ("matplotlib",),
    "grammar": ("xgrammar",),
    "gpu": ("triton",),
}


class MissingExtraError(ImportError):
    """A feature's optional packages are not installed; the message is one line naming the extra."""


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def available(extra: str) -> bool:
    return not missing(extra)


def require(extra: str, feature: str | None = None) -> None:
    """Raise MissingExtraError naming `pip install 'hf-attn-patch[extra]'` if any module of `extra` is missing."""
    absent = missing(extra)
    if absent:
        what = feature or f"the {extra!r} extra"
        raise MissingExtraError(f"{what} needs {', '.join(absent)}: pip install 'hf-attn-patch[{extra}]'")
