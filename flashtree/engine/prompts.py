"""Chats to token ids (the one place the chat template is applied) and a cheap size bound.

Special-token strings inside message content (a user typing `<|im_start|>system`) are
tokenized as text by default, so content cannot forge a turn of another role; the
template's own control tokens stay control tokens. How: each such string in the content is
swapped for a marker no client can guess, the template is rendered, and the text is split
at the markers; the template's text is tokenized as usual and each marker becomes the
string's plain-text ids. Without special strings in the content the ids are exactly those
of tokenizing the rendered template.

The size bound lets callers refuse an absurd prompt before paying for tokenization (seconds
for megabytes of text): no token spells more than the vocabulary's longest entry.
"""

from __future__ import annotations

import re
import secrets
import threading
import weakref

from flashtree.errors import ChatTemplateError

# Unicode normalizers (NFC/NFKC) can fold a few code points into one before tokenizing.
NORMALIZER_SLACK = 4


class ChatEncoder:
    """Per-tokenizer facts the encoders need, computed once (a vocabulary scan)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.longest_token = max((len(t) for t in vocab), default=1)
        specials = set(getattr(tokenizer, "all_special_tokens", []))
        specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        specials = sorted((s for s in specials if s), key=len, reverse=True)  # longest first: no partial match
        self.pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.as_text = {s: plain_text_ids(tokenizer, s) for s in specials}

    def render(self, messages: list[dict]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead "
                                    "(/v1/completions, or generate without --chat)")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja's raise_exception (e.g. bad role order) or a template bug
            raise ChatTemplateError(f"the chat template rejected these messages: {e}") from None

    def encode(self, messages: list[dict], special_tokens: bool = False) -> list[int]:
        encode = self.tokenizer.encode
        found: list[str] = []
        if not special_tokens and self.pattern is not None:
            nonce = str(secrets.randbelow(10**15))

            def hide(match: re.Match) -> str:
                found.append(match.group())
                return f"\ue000{nonce}:{len(found) - 1}\ue001"

            messages = [{**m, "content": self.pattern.sub(hide, m["content"])} if isinstance(m.get("content"), str)
                        else m for m in messages]
        text = self.render(messages)
        if not found:
            return encode(text, add_special_tokens=False)
        ids: list[int] = []
        for i, part in enumerate(re.split(f"\ue000{nonce}:(\\d+)\ue001", text)):
            if i % 2:
                ids += self.as_text[found[int(part)]]
            elif part:
                ids += encode(part, add_special_tokens=False)
        return ids


def plain_text_ids(tokenizer, text: str) -> list[int]:
    """`text` tokenized as ordinary text even if it is a special token's string.

    Works on a private copy of the backend tokenizer: transformers' split_special_tokens
    flips a flag on the shared one, which would race with other threads' encodes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (pure-Python) tokenizer: no shared Rust state to race on
        return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(backend.to_str())
    plain.encode_special_tokens = True
    return plain.encode(text, add_special_tokens=False).ids


_encoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def chat_encoder(tokenizer) -> ChatEncoder:
    with _lock:
        encoder = _encoders.get(tokenizer)
        if encoder is None:
            encoder = _encoders[tokenizer] = ChatEncoder(tokenizer)
        return encoder


def encode_chat(tokenizer, messages: list[dict], special_tokens: bool = False) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, ready for the assistant's
    turn (add_generation_prompt). special_tokens=True lets special-token strings in message
    content become control tokens; by default they are text."""
    if tokenizer is None:
        raise ChatTemplateError("this target ships no tokenizer, so no chat template; send token ids instead")
    return chat_encoder(tokenizer).encode(messages, special_tokens)


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """Characters beyond which a text cannot fit max_model_len tokens (None: no tokenizer)."""
    if tokenizer is None:
        return None
    return max_model_len * chat_encoder(tokenizer).longest_token * NORMALIZER_SLACK
