"""Incremental detokenization: the text of generated tokens, amortized O(1) per token and exact.

    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    for token in generated:
        new_text = detok.add(token)        # text this token completes (may be "" while a character is incomplete)
    rest = detok.flush()                   # at the end: whatever was held back
    detok.text                             # == decode(prompt + generated) minus decode(prompt)
    detok.offsets                          # start offset in .text of each added token

Exactness rests on decoding a small window of tokens *with context*: ids[prefix:] is decoded and compared with
the already-emitted part ids[prefix:read]; the difference is the new text. The context token before `read` keeps
what a decoder does at the start of a text (SentencePiece strips the first word's leading space, byte-level BPE may
begin inside a character) out of the emitted part, so " Lily" keeps its space. Text ending in U+FFFD (an incomplete
UTF-8 sequence) is held back until a later token completes it, and so is a trailing run of SentencePiece
byte-fallback tokens (<0xE2><0x82><0xAC>): such a run decodes as one UTF-8 string, or as one U+FFFD per byte if it is
invalid, so its text is known only once the run ends. Once text is emitted the window moves on: prefix
<- read, read <- len(ids), so each decode covers the tokens of the last emission plus the new ones.
"""

from __future__ import annotations

import re
import weakref

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 6  # prompt tokens decoded as context before the first generated token
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_BYTE_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_fallback_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's byte-fallback pieces <0x00>..<0xFF> (empty unless its decoder has ByteFallback)."""
    try:
        return _BYTE_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    ids = frozenset()
    if backend is None or "ByteFallback" in repr(backend.decoder):
        ids = frozenset(i for piece, i in tokenizer.get_vocab().items() if _BYTE_PIECE.fullmatch(piece))
    try:
        _BYTE_IDS[tokenizer] = ids
    except TypeError:
        pass
    return ids


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids, skip_special_tokens: bool = True):
        self.ids = [int(t) for t in prompt_ids]
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            # the Rust decoder, without transformers' per-call overhead (what tokenizer.decode runs in that case)
            self._decode_fn = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._decode_fn = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self._byte_ids = byte_fallback_ids(tokenizer)
        # skipped special tokens vanish from the text, so they do not end a byte run
        self._transparent = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._in_run = False  # the last token that shows in the text is a byte-fallback piece
        self.prompt_len = len(self.ids)
        self.read = self.prompt_len  # ids[:read] are fully reflected in the emitted text
        self.prefix = max(0, self.read - PROMPT_CONTEXT)  # window start: context for decoding ids[read:]
        while self.prefix > 0 and (
            self.ids[self.prefix] in self._byte_ids or self.ids[self.prefix] in self._transparent
        ):
            self.prefix -= 1  # never start inside a byte-fallback run (its bytes decode together)
        self._base = self._decode(self.prefix, self.read)  # decode(ids[prefix:read])
        self.text = ""
        self.offsets: list[int] = []

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._decode_fn(self.ids[start:stop]) if (stop is None or stop > start) else ""

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the text it makes final ("" while held back)."""
        self.ids.append(int(token_id))
        self.offsets.append(len(self.text))
        token = self.ids[-1]
        if token not in self._transparent:
            self._in_run = token in self._byte_ids
        if self._in_run:
            return ""  # a byte-fallback run: its text is known when it ends
        window = self._decode(self.prefix)
        if window.endswith(REPLACEMENT) or len(window) <= len(self._base):
            return ""  # incomplete character, or no text yet (skipped special tokens): wait for more
        return self._emit(window)

    def flush(self) -> str:
        """At the end of the sequence: emit what was held back (e.g. a trailing incomplete character as U+FFFD)."""
        window = self._decode(self.prefix)
        return self._emit(window) if len(window) > len(self._base) else ""

    def _emit(self, window: str) -> str:
        if window.startswith(self._base):
            new = window[len(self._base) :]
        else:  # the decoder changed text before `read` (not seen with SentencePiece / byte-level BPE): re-anchor
            new = self._resync()
        self.text += new
        self.prefix, self.read = self.read, len(self.ids)
        self._base = self._decode(self.prefix, self.read)
        return new

    def _resync(self) -> str:
        """The exact new text from a full decode (O(length); only when a window was not prefix-stable)."""
        prompt_text = self._decode(0, self.prompt_len)
        full = self._decode(0)
        expected = full[len(prompt_text) :] if full.startswith(prompt_text) else full[len(_common(full, prompt_text)) :]
        return expected[len(self.text) :] if expected.startswith(self.text) else ""


def _common(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]
