"""Object keys in any order for llguidance, which generates an object's ``properties`` in their declaration order.

:func:`any_order` rewrites an object's ``properties`` as anchored ``patternProperties`` (the backend accepts those
keys in any order); what the grammar can then no longer say (``required``, min / maxProperties, no repeated key) is
checked exactly (checked_matcher.py). The cost: every rewritten object is checked where it closes, and llguidance's
compile time grows about cubically with an object's pattern properties (SmolLM2's vocabulary, one object of K
properties, any order against declaration order: 0.17 / 0.06 s at K = 64, 0.5 / 0.07 s at 128, 7 s at 256, 82 s at
512), so objects with more than ANY_ORDER_MAX_PROPERTIES properties keep their declaration order.
"""

from __future__ import annotations

ANY_ORDER_MAX_PROPERTIES = 64


def any_order(sub: dict, changed: list) -> None:
    """An object's ``properties`` as anchored ``patternProperties``, which llguidance accepts in any order;
    ``required`` and min / maxProperties, which it cannot say then, are checked exactly, with no repeated key
    (checked_matcher.py). Kept in declaration order: objects with more than ANY_ORDER_MAX_PROPERTIES properties
    (compile time, module docstring), objects with ``patternProperties`` of their own, and objects beside an
    ``anyOf`` / ``oneOf`` / ``allOf`` (llguidance intersects their branches with pattern properties wrongly: keys it
    should allow are refused)."""
    props = sub.get("properties")
    if (
        not isinstance(props, dict)
        or not props
        or len(props) > ANY_ORDER_MAX_PROPERTIES
        or any(k in sub for k in ("patternProperties", "anyOf", "oneOf", "allOf"))
    ):
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
