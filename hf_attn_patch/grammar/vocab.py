"""Tokenizer adaptation: what each token id means in bytes, and the backends' tokenizer objects, built once per
tokenizer.

The backends need the byte string of every token. For fast (Rust ``tokenizers``) tokenizers both backends read
it from the tokenizer themselves (llguidance: ``llguidance.hf.from_tokenizer``; xgrammar:
``TokenizerInfo.from_huggingface``). For other tokenizers :func:`token_bytes` decodes the vocabulary here:
byte-level BPE (GPT-2 ``Ġ``-style characters), SentencePiece (``▁`` = space, ``<0xNN>`` byte-fallback pieces),
and added / special tokens (empty: a grammar can never produce them).

Adapters are cached per tokenizer object (weakly, so a dropped tokenizer frees its adapter) and per vocabulary
fingerprint (two loads of the same tokenizer share one adapter).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from functools import lru_cache

from .errors import GrammarError

logger = logging.getLogger(__name__)

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_LOCK = threading.Lock()
_BY_OBJECT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BY_FINGERPRINT: "OrderedDict[tuple, TokenizerAdapter]" = OrderedDict()
_MAX_FINGERPRINTS = 8


@lru_cache(maxsize=1)
def _byte_decoder() -> dict:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in character -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _vocab_style(tokenizer, pieces: list) -> str:
    """'byte_level' | 'sentencepiece' | 'raw', from the tokenizer's decoder if it says, else from the pieces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
        except Exception:  # noqa: BLE001  (an unserialisable decoder just means "look at the pieces")
            decoder = {}
        text = json.dumps(decoder)
        if '"ByteLevel"' in text:
            return "byte_level"
        if '"ByteFallback"' in text or '"Metaspace"' in text or "\\u2581" in text:
            return "sentencepiece"
    sample = [p for p in pieces if p][:5000]
    if sum(p.startswith("▁") for p in sample) > len(sample) // 20 or any(_BYTE_PIECE.match(p) for p in sample):
        return "sentencepiece"
    if sum(("Ġ" in p) or ("Ċ" in p) for p in sample) > len(sample) // 50:
        return "byte_level"
    return "raw"


def token_bytes(tokenizer) -> tuple[list[bytes], list[int]]:
    """(bytes of every token id, ids of special tokens) for any HF tokenizer. Special tokens decode to b""."""
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    pieces = [p if isinstance(p, str) else "" for p in pieces]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(int(tid))
    style = _vocab_style(tokenizer, pieces)
    decoder = _byte_decoder()
    out: list[bytes] = []
    for tid, piece in enumerate(pieces):
        if tid in special:
            out.append(b"")
        elif style == "byte_level":
            try:
                out.append(bytes(decoder[c] for c in piece))
            except KeyError:  # an added non-special token stored as plain text
                out.append(piece.encode("utf-8"))
        elif style == "sentencepiece":
            m = _BYTE_PIECE.match(piece)
            out.append(bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode("utf-8"))
        else:
            out.append(piece.encode("utf-8"))
    return out, sorted(special)


def vocab_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary (token -> id, added tokens): equal for two loads of the same tokenizer."""
    h = hashlib.sha1()
    h.update(type(tokenizer).__name__.encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
    h.update(str(len(tokenizer)).encode())
    return h.hexdigest()


def normalize_eos(tokenizer, eos_token_id) -> tuple[int, ...]:
    """The EOS ids as a sorted tuple: `eos_token_id` (int or list) if given, else the tokenizer's."""
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            raise GrammarError("eos_token_id: the tokenizer has no eos_token_id; pass eos_token_id=<id or list of ids>")
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or not all(isinstance(i, int) and 0 <= i for i in ids):
        raise GrammarError(
            f"eos_token_id: expected a non-negative int or a non-empty list of them, got {eos_token_id!r}"
        )
    return tuple(sorted(set(ids)))


def _special_ids(tokenizer, eos_token_ids) -> tuple[int, ...]:
    """Special / control token ids other than EOS: never part of a grammar's text (some backends let them through)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(int(tid))
    return tuple(sorted(special - set(eos_token_ids)))


class TokenizerAdapter:
    """The backends' views of one tokenizer (+ EOS ids). Build with :func:`get_adapter`, not directly.

    vocab_size: number of token ids the tokenizer knows (``len(tokenizer)``): the width of the grammar masks.
    eos_token_ids: the ids that end a row; allowed only where the grammar accepts.
    special_token_ids: the other special tokens; never allowed.
    """

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], fingerprint: str):
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.special_token_ids = _special_ids(tokenizer, eos_token_ids)
        self.fingerprint = fingerprint
        self._tokenizer_ref = weakref.ref(tokenizer)
        self._llg = None
        self._bytes = None
        self._xgr_info = None
        self._xgr_compiler = None
        self._lock = threading.Lock()

    def _tokenizer(self):
        tok = self._tokenizer_ref()
        if tok is None:
            raise RuntimeError("the tokenizer this adapter was built from has been garbage-collected")
        return tok

    def token_bytes(self) -> list:
        """Bytes of every token id (special tokens: b""), decoded once."""
        with self._lock:
            if self._bytes is None:
                self._bytes = token_bytes(self._tokenizer())[0]
            return self._bytes

    def llguidance_tokenizer(self):
        """llguidance.LLTokenizer for this vocabulary (built once)."""
        with self._lock:
            if self._llg is None:
                import llguidance
                import llguidance.hf

                tok = self._tokenizer()
                try:
                    self._llg = llguidance.hf.from_tokenizer(
                        tok, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
                    )
                except Exception as err:  # noqa: BLE001  (not a fast tokenizer: decode the vocabulary ourselves)
                    logger.info("llguidance.hf.from_tokenizer failed (%s); using the decoded vocabulary", err)
                    self._llg = llguidance.LLTokenizer(
                        llguidance.TokenizerWrapper(_WrappedVocab(tok, self.eos_token_ids)),
                        n_vocab=self.vocab_size,
                        eos_token=list(self.eos_token_ids),
                    )
            return self._llg

    def xgrammar_compiler(self):
        """xgrammar.GrammarCompiler for this vocabulary (built once; it caches compiled grammars itself)."""
        with self._lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                tok = self._tokenizer()
                stop = list(self.eos_token_ids)
                try:
                    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size, stop_token_ids=stop)
                except Exception as err:  # noqa: BLE001
                    logger.info(
                        "xgrammar TokenizerInfo.from_huggingface failed (%s); using the decoded vocabulary", err
                    )
                    vocab, _ = token_bytes(tok)
                    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=stop)
                self._xgr_info = info
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._xgr_compiler


class _WrappedVocab:
    """The duck-typed tokenizer llguidance.TokenizerWrapper expects, from the decoded vocabulary."""

    def __init__(self, tokenizer, eos_token_ids):
        self.tokens, self.special_token_ids = token_bytes(tokenizer)
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        skip = set(self.special_token_ids)
        self._by_bytes = {}
        for tid, b in enumerate(self.tokens):
            if b and tid not in skip:
                self._by_bytes.setdefault(b, tid)
        self._longest = max((len(b) for b in self._by_bytes), default=1)

    def __call__(self, text) -> list[int]:
        """Greedy longest-match tokenization over the decoded vocabulary: byte-exact, with no SentencePiece prefix
        space (the HF tokenizer's own encode() would add one)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._by_bytes.get(data[i : i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]:#04x} has no token in this vocabulary")
        return out


def get_adapter(tokenizer, eos_token_id=None) -> TokenizerAdapter:
    """The cached :class:`TokenizerAdapter` of `tokenizer` with these EOS ids (built on first use)."""
    if tokenizer is None or not hasattr(tokenizer, "convert_ids_to_tokens") or not hasattr(tokenizer, "get_vocab"):
        raise GrammarError(f"tokenizer: expected a Hugging Face tokenizer, got {type(tokenizer).__name__}")
    eos = normalize_eos(tokenizer, eos_token_id)
    with _LOCK:
        per_object = _BY_OBJECT.get(tokenizer)
        if per_object is not None and eos in per_object:
            return per_object[eos]
    fingerprint = vocab_fingerprint(tokenizer)
    with _LOCK:
        adapter = _BY_FINGERPRINT.get((fingerprint, eos))
        if adapter is None or adapter._tokenizer_ref() is None:
            adapter = TokenizerAdapter(tokenizer, eos, fingerprint)
            _BY_FINGERPRINT[(fingerprint, eos)] = adapter
            while len(_BY_FINGERPRINT) > _MAX_FINGERPRINTS:
                _BY_FINGERPRINT.popitem(last=False)
        else:
            _BY_FINGERPRINT.move_to_end((fingerprint, eos))
        _BY_OBJECT.setdefault(tokenizer, {})[eos] = adapter
    return adapter
