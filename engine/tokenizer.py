"""The runtime tokenizer: a model directory's `tokenizer.json`, read with the `tokenizers` library."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import tokenizers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"

_REPLACEMENT = "\ufffd"
# Tokens of text pieces kept for the next request (8 bytes each): an agent re-sends its conversation every turn.
SEGMENT_CACHE_TOKENS = 4_000_000


def byte_level_chars() -> list[str]:
    """The byte-level (GPT-2) alphabet: the character that stands for each byte 0..255 in the vocabulary. Printable
    bytes stand for themselves; the rest are shifted to U+0100 onwards in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]


class Tokenizer:
    """Text <-> token ids for one model. Special-token strings inside the text encode to their single ids."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, source: str = "<memory>") -> None:
        self._tok = tokenizer
        ids = {token: tokenizer.token_to_id(token) for token in (BOS_TOKEN, EOS_TOKEN)}
        missing = [token for token, id_ in ids.items() if id_ is None]
        if missing:
            raise ValueError(f"{source}: the vocabulary has no {', '.join(missing)}")
        self._bos_id: int = ids[BOS_TOKEN]
        self._eos_id: int = ids[EOS_TOKEN]
        self._segments = SegmentCache.for_tokenizer(tokenizer)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        model_dir = Path(path)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory not found: {model_dir}")
        file = model_dir / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in the model directory: {file}")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for every parse error
            raise ValueError(f"cannot read {file}: {exc}") from exc
        return cls(tokenizer, source=str(file))

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (a checkpoint may pad its embedding beyond this)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token's piece is written with (a byte-level piece's characters are each
        one byte or more of it): no text of more than `n * max_token_bytes` bytes encodes to n tokens or fewer. A
        normalizer may shorten text before it is split, Unicode NFKC by at most 3x (a 3-byte fullwidth letter to one
        byte), hence the factor."""
        longest = max(len(piece.encode()) for piece in self._tok.get_vocab(with_added_tokens=True))
        return longest * (1 if self._tok.normalizer is None else 3)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if self._segments is not None:
            ids = self._segments.encode(text)
        else:
            # The batch call releases the GIL while it works (a single encode holds it, stalling every other thread
            # of the server for as long as a long prompt takes: seconds for megabytes).
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return [self._bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes as decoding writes them, None for a control token (BOS, EOS, turn markers) that is never
        text: what a grammar over the vocabulary needs. Markup tokens (``<think>``, ``｜DSML｜``) are text. Only a
        byte-level vocabulary says this exactly, since a byte token may hold part of a character."""
        if not isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel):
            raise ValueError(f"token bytes need a byte-level tokenizer; this one decodes with {self._tok.decoder!r}")
        byte_of = {char: byte for byte, char in enumerate(byte_level_chars())}
        added = self._tok.get_added_tokens_decoder()
        result: list[bytes | None] = []
        for token_id in range(self.vocab_size):
            if token_id in added:
                token = added[token_id]
                result.append(None if token.special else token.content.encode())
            else:
                piece = self._tok.id_to_token(token_id)  # None for an id the vocabulary skips
                result.append(None if piece is None else bytes(byte_of[char] for char in piece))
        return result


class IncrementalDetokenizer:
    """Streams text as token ids arrive. `step` returns only newly completed text and holds back a character whose
    UTF-8 bytes are still incomplete; the concatenation of every `step` and the final `flush` equals `decode(ids)`.
    Stop strings are checked by the caller on the accumulated deltas."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Ids since the last clean character boundary, and how much of their text was already returned.
        self._pending: list[int] = []
        self._emitted = 0

    def step(self, token_id: int) -> str:
        self._pending.append(token_id)
        text = self._tokenizer.decode(self._pending, self._skip)
        if text.endswith(_REPLACEMENT):
            # Byte-level decoding turns a partial UTF-8 sequence into one trailing U+FFFD that later bytes may
            # complete; everything before it is final. A run of such tokens is re-decoded as a whole, which stays
            # short because a character is at most 4 bytes (only garbage output keeps ending mid-character).
            stable = text[:-1]
            delta = stable[self._emitted :]
            self._emitted = len(stable)
            return delta
        # Decoding is a byte concatenation, so text that ends on a whole character is a clean cut: start afresh.
        delta = text[self._emitted :]
        self._pending.clear()
        self._emitted = 0
        return delta

    def flush(self) -> str:
        """The held-back remainder (a truncated character decodes to U+FFFD, as in `decode`)."""
        delta = self._tokenizer.decode(self._pending, self._skip)[self._emitted :]
        self._pending.clear()
        self._emitted = 0
        return delta


class SegmentCache:
    """Encodes text a piece at a time, the pieces between added tokens, and keeps the pieces' tokens (least recently
    used out first): a conversation re-sent with a turn more costs the new turn's tokenization, not the whole's.
    Exact: the library itself splits text at added tokens first and encodes each piece on its own, so the pieces'
    tokens and the added tokens' ids, in order, are what one encode of the whole text gives. That holds for added
    tokens matched verbatim (no lstrip, rstrip or single-word rule; unnormalised, or no normalizer): `for_tokenizer`
    gives None for a tokenizer with others, which then encodes whole."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, added: dict[str, int], max_tokens: int):
        self._tok, self._added, self._max_tokens = tokenizer, added, max_tokens
        self._by_head: dict[str, list[str]] = {}  # added tokens by their first character, longest first
        for token in sorted(added, key=len, reverse=True):
            self._by_head.setdefault(token[0], []).append(token)
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()  # requests are tokenized on several threads

    @classmethod
    def for_tokenizer(cls, tokenizer: tokenizers.Tokenizer) -> SegmentCache | None:
        added = tokenizer.get_added_tokens_decoder()
        verbatim = all(
            not (t.lstrip or t.rstrip or t.single_word or (t.normalized and tokenizer.normalizer is not None))
            for t in added.values()
        )
        if not added or not verbatim:
            return None
        return cls(tokenizer, {t.content: i for i, t in added.items()}, SEGMENT_CACHE_TOKENS)

    def split(self, text: str) -> list[str]:
        """text at its added tokens: piece, added token, piece, ..., piece; leftmost, then longest, as the library
        matches them. str.find of each token's first character, where a regex alternation of the tokens scanned a
        120 KB conversation in 1.1 ms (0.3 ms this way)."""
        parts, start = [], 0
        found = {head: text.find(head) for head in self._by_head}  # each first character's next place
        while live := [at for at in found.values() if at >= 0]:
            at = min(live)
            token = next((t for t in self._by_head[text[at]] if text.startswith(t, at)), None)
            resume = at + 1 if token is None else at + len(token)
            if token is not None:
                parts += [text[start:at], token]
                start = resume
            for head, place in found.items():
                if 0 <= place < resume:
                    found[head] = text.find(head, resume)
        parts.append(text[start:])
        return parts

    def encode(self, text: str) -> list[int]:
        parts = self.split(text)  # piece, added token, piece, ..., piece
        pieces = parts[0::2]
        with self._lock:
            known = {piece: self._take(piece) for piece in pieces if piece}
        missing = [piece for piece, ids in known.items() if ids is None]
        if missing:  # one batch call: it releases the GIL and encodes the pieces in parallel
            for piece, encoding in zip(missing, self._tok.encode_batch(missing, add_special_tokens=False),
                                       strict=True):  # fmt: skip
                known[piece] = array("q", encoding.ids)
            with self._lock:
                for piece in missing:
                    self._keep(piece, known[piece])
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._added[part])
            elif part:
                ids.extend(known[part])
        return ids

    def _take(self, piece: str) -> array | None:
        ids = self._pieces.get(piece)
        if ids is not None:
            self._pieces.move_to_end(piece)
        return ids

    def _keep(self, piece: str, ids: array) -> None:
        if piece in self._pieces or len(ids) > self._max_tokens:
            return
        self._pieces[piece] = ids
        self._tokens += len(ids)
        while self._tokens > self._max_tokens:
            _, dropped = self._pieces.popitem(last=False)
            self._tokens -= len(dropped)
