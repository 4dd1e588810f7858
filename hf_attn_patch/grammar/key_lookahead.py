"""Keys in any order: a key that can only repeat one is masked as it starts, not where it closes.

With keys in any order (schema_keys.py) the grammar allows a key twice; the exact checks refuse the repeat where
the key closes (checked_matcher.py). In a closed object (``additionalProperties: false``, no pattern properties)
that is too late: once a key's prefix only matches names already present, every continuation fails, and a row
without a retry ends as check_failed. So in such an object a token that opens a key (after ``{`` or ``,``) or
extends one (a token may close values and write a comma and a quote at once) is masked when no name left absent
starts with the key written so far (the names left absent empty: no further key at all). Exact pruning, like the
uniqueItems items of enum strings: it costs no attempt.
"""

from __future__ import annotations

import functools
import json

from .json_scan import _prefixes


def closed_names(checks, path: tuple):
    """The property names an object at instance `path` may have (frozenset), or None if the schemas there allow
    other names (cached on `checks`, shared by the rows of a schema). Several closed subschemas: the names all of
    them allow."""
    key = ("closed names", path)
    if key not in checks._results:
        names = None
        for node in checks.nodes_at(path):
            if node.get("additionalProperties") is False and not node.get("patternProperties"):
                props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
                names = frozenset(props) if names is None else names & frozenset(props)
        checks._results[key] = names
    return checks._results[key]


def key_pool(matcher, state, text: bytes):
    """The tokens that may open or extend a key of a closed, checked object from the scanner `state` ([V] bool: all
    of them inside such a key, else those holding a quote or a comma), or None if no such object is open."""
    if not isinstance(state, tuple) or not state[0]:
        return None
    checks, scalar = matcher.checks, state[1]
    for depth, frame in enumerate(reversed(state[0])):
        if frame[0] != "o":
            continue
        path = matcher._concrete(frame[2], text)
        if checks.roots_at(path)[0] and closed_names(checks, path) is not None:
            in_key = depth == 0 and scalar is not None and scalar[0] == "s" and scalar[2]
            return checks._has["any" if in_key else "key"]
    return None


def futile_key(matcher, state, text: bytes, token: int) -> bool:
    """Whether `token` opens or extends a key of a closed object that only names already present can complete."""
    new, fail = matcher._check_token(state, text, token)
    if fail or not isinstance(new, tuple) or not new[0] or new[0][-1][0] != "o":
        return False
    full = text + matcher.checks.token_bytes[token]
    frame, scalar = new[0][-1], new[1]
    if scalar is not None:
        if scalar[0] != "s" or not scalar[2]:
            return False
        start = scalar[1]
    elif frame[3] == "k":  # after a comma: a key must follow
        start = len(full)
    else:
        return False
    prefix = full[start:]
    names = closed_names(matcher.checks, matcher._concrete(frame[2], full))
    if names is None or b"\\" in prefix:
        return False
    present = _object_keys(full[frame[1] : start].rstrip(b" \t\n\r,"))
    return present is not None and prefix not in _prefixes(names - present)  # pruning: no failure of its own


@functools.lru_cache(maxsize=256)
def _object_keys(members: bytes):
    """The keys of an object text without its closing brace (b'{"a": 1'), None if not JSON."""
    if members == b"{":
        return frozenset()
    pairs: list = []
    try:
        json.loads(members + b"}", object_pairs_hook=lambda kv: pairs.append(kv) or {})
    except ValueError:
        return None
    return frozenset(k for k, _ in pairs[-1])
