"""The attempt budget of a checked row (checked_matcher.py): how often the model was kept from closing one value.

A step whose mask forbids a closing token because the closed value would fail its exact check is an attempt of
that value (keyed by the value's start offset). Steps count once per length of the text without trailing
whitespace, so a model that only adds whitespace before a refused close spends one attempt, and a value's count
depends on the committed text alone (a rollback forgets the attempts made past it: speculative drafts and retries
count the same as plain decoding). Closes refused by a structural rule are free: a member still missing at an
object's close (``required``, ``minProperties``, ``dependentRequired``) or a repeated key, which a grammar with keys
in declaration order states itself, so keys in any order cost no budget. A row whose value reaches the limit
(``SchemaChecks.max_attempts``) ends with the smallest valid completion (completion.py); that search runs with
``counted`` False (no budget inside it, so it never starts a search of its own).
"""

from __future__ import annotations


class Attempts:
    """Refused closes per value: {value start offset: {text lengths (trailing whitespace dropped) of the steps}}."""

    def __init__(self, counted: bool = True):
        self.counted = counted
        self.tries: dict[int, set[int]] = {}

    def add(self, starts, text: bytes, limit: int) -> bool:
        """Count one attempt of each value starting at an offset in `starts`, at `text`; True when one of them has
        had `limit` attempts."""
        if not self.counted:
            return False
        grown = len(text.rstrip(b" \t\n\r"))
        out = False
        for start in starts:
            seen = self.tries.setdefault(start, set())
            seen.add(grown)
            out |= len(seen) >= limit
        return out

    def rollback(self, length: int) -> None:
        """Forget the values and the attempts past a text of `length` bytes."""
        self.tries = {s: {g for g in v if g <= length} for s, v in self.tries.items() if s < length}

    def copy(self) -> "Attempts":
        other = Attempts(self.counted)
        other.tries = {s: set(v) for s, v in self.tries.items()}
        return other
