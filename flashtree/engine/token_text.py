"""Each token on its own, as logprobs list them: its text and its exact bytes.

A token's text is the tokenizer's decode of it alone. Its bytes are what the token spells, which
for a piece of a multi-byte character is not the text's UTF-8 (that is a replacement
character): byte-level BPE vocabularies (GPT-2, Qwen, Llama 3) map each byte to a printable
character, and SentencePiece ones spell raw bytes as <0xNN> and spaces as U+2581; both are read
back here. Other vocabularies fall back to the text's UTF-8.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """(text, bytes) per token id, computed once per id (thread-safe: the server's event loop
    asks while the engine thread decodes)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = type(getattr(backend, "decoder", None)).__name__
        self.byte_level = decoder == "ByteLevel"
        self.cache: dict[int, tuple[str, bytes]] = {}
        self.lock = threading.Lock()

    def pieces(self, ids: list[int]) -> list[tuple[str, bytes]]:
        missing = [i for i in set(ids) if i not in self.cache]
        if missing:
            found = {i: self._piece(i) for i in missing}
            with self.lock:
                self.cache.update(found)
        return [self.cache[i] for i in ids]

    def _piece(self, token: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([token])
        raw = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(raw, str):
            if self.byte_level:
                table = _byte_level_decoder()
                if all(c in table for c in raw):
                    return text, bytes(table[c] for c in raw)
            elif (m := BYTE_TOKEN.fullmatch(raw)) is not None:
                return text, bytes([int(m.group(1), 16)])
            elif "\u2581" in raw and "\ufffd" not in raw:
                return text, raw.replace("\u2581", " ").encode()
        return text, text.encode()
