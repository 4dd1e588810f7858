"""JSON Schema formats checked exactly: jsonschema's format checker plus the formats real schemas use.

jsonschema checks the formats of the JSON Schema specification (date-time, date, time, duration, email, idn-email,
hostname, idn-hostname, ipv4, ipv6, uri, uri-reference, iri, iri-reference, uuid, uri-template per RFC 6570,
json-pointer, relative-json-pointer, regex) with the packages of its ``format-nongpl`` extra, a dependency of
hf-attn-patch. Added here: the OpenAPI formats (int32, int64, float, double, byte; binary and password, which admit
any string) and draft-03's names (host-name, ip-address). :func:`format_checker` is the one checker every exact
check uses; :func:`known_formats` the names it knows (a ``format`` outside them is an annotation: any string passes,
and the compiler warns once per schema).
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

_INT32 = 2**31
_INT64 = 2**63
_FLOAT32_MAX = 3.4028234663852886e38
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int32(value) -> bool:
    return not _number(value) or (float(value).is_integer() and -_INT32 <= value < _INT32)


def _int64(value) -> bool:
    return not _number(value) or (float(value).is_integer() and -_INT64 <= value < _INT64)


def _float(value) -> bool:
    return not _number(value) or (math.isfinite(value) and abs(value) <= _FLOAT32_MAX)


def _double(value) -> bool:  # a number too large for a double reads as infinity
    return not _number(value) or math.isfinite(value)


def _byte(value) -> bool:
    return not isinstance(value, str) or _BASE64.fullmatch(value) is not None


def _any_string(value) -> bool:
    return True


@lru_cache(maxsize=1)
def format_checker():
    """jsonschema's FormatChecker with the formats above added."""
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    checker.checkers.update(jsonschema.FormatChecker().checkers)  # every draft's; the 2020-12 meaning wins ("time"
    checker.checkers.update(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)  # with its offset, not draft 3's)
    added = {
        "int32": _int32,
        "int64": _int64,
        "float": _float,
        "double": _double,
        "byte": _byte,
        "binary": _any_string,
        "password": _any_string,
    }
    for alias, name in (("host-name", "hostname"), ("ip-address", "ipv4")):
        if name in checker.checkers:
            added[alias] = checker.checkers[name][0]
    for name, fn in added.items():
        if name not in checker.checkers:
            checker.checks(name)(fn)
    return checker


def known_formats() -> frozenset:
    return frozenset(format_checker().checkers)
