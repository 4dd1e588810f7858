"""Object keys in any order for llguidance, which generates an object's ``properties`` in their declaration order.

:func:`any_order` rewrites an object's ``properties`` as anchored ``patternProperties`` (the backend accepts those
keys in any order); what the grammar can then no longer say (``required``, min / maxProperties, no repeated key) is
checked exactly (checked_matcher.py). The cost: every rewritten object is checked where it closes.
"""

from __future__ import annotations


def any_order(sub: dict, changed: list) -> None:
    """An object's ``properties`` as anchored ``patternProperties``, which llguidance accepts in any order;
    ``required`` and min / maxProperties, which it cannot say then, are checked exactly, with no repeated key
    (checked_matcher.py). Kept in declaration order: objects with ``patternProperties`` of their own, and objects
    beside an ``anyOf`` / ``oneOf`` / ``allOf`` (llguidance intersects their branches with pattern properties
    wrongly: keys it should allow are refused)."""
    props = sub.get("properties")
    if not isinstance(props, dict) or not props or "patternProperties" in sub or any(
            k in sub for k in ("anyOf", "oneOf", "allOf")):
        return
    sub["patternProperties"] = {"^" + regex_literal(k) + "$": v for k, v in props.items()}
    del sub["properties"]
    changed.append("properties")  # the order only; every object so rewritten is checked at its close
    for key in ("required", "minProperties", "maxProperties"):
        if key in sub:
            del sub[key]
            changed.append(key)


def regex_literal(text: str) -> str:
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}-" else c for c in text)
