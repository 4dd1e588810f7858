"""A byte-level JSON scanner with immutable states, for the exact checks (checked_matcher.py).

It tracks where every value starts and closes, and its instance path, so that a value can be validated the moment
it closes. It does not judge the grammar: text that is not JSON makes :func:`scan` return None (the grammar decides).
"""

from __future__ import annotations

import functools
import json

_NUMBER_BYTES = frozenset(b"0123456789+-.eE")
_WS = frozenset(b" \t\n\r")

# Before the scanner states, in a tagged_json grammar (SchemaChecks.frame): inside the open tag, and free text.
_BEFORE, _FREE = "before", "free"
# A scanner state is immutable: (stack, scalar, top). stack: tuple of frames (kind "o"/"a", start offset, path,
# phase, key, index); scalar: None or ("s", start, is_key, escaped) / ("n", start) / ("l", start, bytes left);
# top: "start" | "done" (the top-level value closed).
INITIAL = ((), None, "start")


def _value_path(stack) -> tuple:
    if not stack:
        return ()
    kind, _, path, _, key, index = stack[-1]
    return path + ((key,) if kind == "o" else (index,))


def scan(state, data: bytes, offset: int, closes: list):
    """Advance `state` over `data` (bytes starting at text offset `offset`); append (path, start, end) of every value
    that closes, in order, to `closes` as (path, start, end, start of its container or None); an object key that
    closes as (None, start, end, (start of its object, the object's path)). Returns the new state
    (None if `data` is not JSON: the grammar decides)."""
    stack, scalar, top = state
    pos = offset
    for b in data:
        # ---- inside a scalar
        if scalar is not None:
            kind = scalar[0]
            if kind == "s":
                if scalar[3]:
                    scalar = ("s", scalar[1], scalar[2], False)
                elif b == 0x5C:  # backslash
                    scalar = ("s", scalar[1], scalar[2], True)
                elif b == 0x22:  # closing quote
                    start, is_key = scalar[1], scalar[2]
                    scalar = None
                    if is_key:
                        frame = stack[-1]
                        stack = stack[:-1] + ((frame[0], frame[1], frame[2], ":", (start, pos + 1), frame[5]),)
                        closes.append((None, start, pos + 1, (frame[1], frame[2])))  # a key
                    else:
                        closes.append((_value_path(stack), start, pos + 1, _parent(stack)))
                        stack, top = _after_value(stack, top)
                pos += 1
                continue
            if kind == "l":
                left = scalar[2] - 1
                if left == 0:
                    closes.append((_value_path(stack), scalar[1], pos + 1, _parent(stack)))
                    scalar = None
                    stack, top = _after_value(stack, top)
                else:
                    scalar = ("l", scalar[1], left)
                pos += 1
                continue
            if b in _NUMBER_BYTES:
                pos += 1
                continue
            closes.append((_value_path(stack), scalar[1], pos, _parent(stack)))  # a number ends before this byte
            scalar = None
            stack, top = _after_value(stack, top)
        # ---- between tokens of the structure
        if b in _WS:
            pos += 1
            continue
        if stack:
            kind, start, path, phase, key, index = stack[-1]
            if kind == "o":
                if phase in ("k?", "k") and b == 0x22:
                    scalar = ("s", pos, True, False)
                elif phase == "k?" and b == 0x7D or phase == "," and b == 0x7D:
                    closes.append((path, start, pos + 1, _parent(stack[:-1])))
                    stack, top = _after_value(stack[:-1], top)
                elif phase == "," and b == 0x2C:
                    stack = stack[:-1] + ((kind, start, path, "k", None, index),)
                elif phase == ":" and b == 0x3A:
                    stack = stack[:-1] + ((kind, start, path, "v", key, index),)
                elif phase == "v":
                    stack, scalar = _open_value(stack, b, pos)
                    if stack is None:
                        return None
                else:
                    return None
            else:
                if phase in ("v?", ",") and b == 0x5D:
                    closes.append((path, start, pos + 1, _parent(stack[:-1])))
                    stack, top = _after_value(stack[:-1], top)
                elif phase == "," and b == 0x2C:
                    stack = stack[:-1] + ((kind, start, path, "v", None, index + 1),)
                elif phase in ("v?", "v"):
                    stack = stack[:-1] + ((kind, start, path, "v", None, index),)
                    stack, scalar = _open_value(stack, b, pos)
                    if stack is None:
                        return None
                else:
                    return None
        elif top == "start":
            stack, scalar = _open_value(stack, b, pos)
            if stack is None:
                return None
            top = "value"
        else:
            return None
        pos += 1
    return stack, scalar, top


def _parent(stack):
    """Text offset where the innermost open container starts (None at the top level)."""
    return stack[-1][1] if stack else None


def _open_value(stack, b, pos):
    """A value starts with byte b at pos -> (stack, scalar); (None, None) for a byte that starts no value."""
    if b == 0x22:
        return stack, ("s", pos, False, False)
    if b == 0x7B:
        return stack + (("o", pos, _value_path(stack), "k?", None, 0),), None
    if b == 0x5B:
        return stack + (("a", pos, _value_path(stack), "v?", None, 0),), None
    if b in _NUMBER_BYTES:
        return stack, ("n", pos)
    if b == 0x74 or b == 0x6E:  # true / null
        return stack, ("l", pos, 3)
    if b == 0x66:  # false
        return stack, ("l", pos, 4)
    return None, None


def _after_value(stack, top):
    if not stack:
        return stack, "done"
    kind, start, path, _, key, index = stack[-1]
    return stack[:-1] + ((kind, start, path, ",", key, index),), top


@functools.lru_cache(maxsize=64)
def _prefixes(strings: frozenset) -> frozenset:
    """Every prefix of the JSON texts of `strings` (ASCII escapes or not; b"" if there is one)."""
    forms = {json.dumps(v, ensure_ascii=a).encode() for v in strings for a in (True, False)}
    return frozenset(f[:i] for f in forms for i in range(len(f) + 1))


@functools.lru_cache(maxsize=256)
def _items(array: bytes):
    """The items of a JSON array text (hashable ones as a set, else the list), None if not JSON."""
    try:
        items = json.loads(array)
    except ValueError:
        return None
    return set(items) if all(isinstance(v, str) for v in items) else items


def _key(data: bytes) -> str:
    """A JSON key text -> the key ("" if it is not JSON yet)."""
    try:
        return json.loads(data)
    except ValueError:
        return ""
