"""JSON Schema formats checked exactly: jsonschema's format checker plus the formats real schemas use.

:func:`format_checker` is the one checker every exact check uses; :func:`known_formats` the names it knows (a
``format`` outside them is an annotation: any string passes, and the compiler says so once per schema).
"""

from __future__ import annotations

import datetime
import re
from functools import lru_cache


def _format_checker():
    """jsonschema's format checker plus exact checks for the common formats it needs extra packages for."""
    import jsonschema

    checker = jsonschema.FormatChecker()
    rfc3339_time = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"

    def _date_time(value):
        if not isinstance(value, str):
            return True
        m = re.fullmatch(r"(\d{4}-\d{2}-\d{2})[Tt ]" + rfc3339_time, value, re.ASCII)
        if not m:
            return False
        try:
            datetime.date.fromisoformat(m.group(1))
        except ValueError:
            return False
        return True

    def _time(value):
        return not isinstance(value, str) or re.fullmatch(rfc3339_time, value, re.ASCII) is not None

    def _uri(value):  # RFC 3986 absolute URI: scheme ":" then allowed characters only
        return not isinstance(value, str) or re.fullmatch(
            r"[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*", value) is not None

    def _uri_reference(value):
        return not isinstance(value, str) or re.fullmatch(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*", value) is not None

    def _hostname(value):
        return not isinstance(value, str) or (len(value) <= 253 and re.fullmatch(
            r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?",
            value, re.ASCII) is not None)

    def _duration(value):
        return not isinstance(value, str) or re.fullmatch(
            r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?", value, re.ASCII) is not None

    def _json_pointer(value):
        return not isinstance(value, str) or re.fullmatch(r"(/([^~/]|~[01])*)*", value) is not None

    for name, fn in (("date-time", _date_time), ("time", _time), ("uri", _uri), ("uri-reference", _uri_reference),
                     ("iri", _uri), ("iri-reference", _uri_reference), ("hostname", _hostname),
                     ("duration", _duration), ("json-pointer", _json_pointer)):
        if name not in checker.checkers:
            checker.checks(name)(fn)
    return checker


@lru_cache(maxsize=1)
def format_checker():
    return _format_checker()


def known_formats() -> frozenset:
    return frozenset(format_checker().checkers)

