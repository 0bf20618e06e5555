"""Byte-level BPE tokenizer for the demo target, trained on the corpus train split.

Byte-level so any text (including odd bytes in source files) encodes and
decodes losslessly; no prefix space and no cleanup of spaces, because the
engine compares decoded text against plain HF generation. `<|mask|>` exists
only for the DFlash drafter, which fills unknown block positions with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from flashtree.train.corpus import train_documents

VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, MASK]  # ids 0..3, in this order

# Splits words, single digits, punctuation runs (with trailing newlines) and
# whitespace runs, so indentation becomes a few reusable tokens.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML; the generation prompt opens an assistant turn for the model to fill.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def new_tokenizer() -> Tokenizer:
    """Untrained byte-level BPE pipeline (no normalizer: text must round-trip exactly)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train BPE; `vocab_size` counts the special tokens and the 256 byte symbols."""
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> Path:
    """Write the files `transformers.AutoTokenizer.from_pretrained` expects."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    specials = {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": [IM_START, IM_END, MASK]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "mask_token": MASK,
        "additional_special_tokens": [IM_START, IM_END, MASK],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "padding_side": "left",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({**specials, "mask_token": MASK}, indent=2) + "\n")
    return out


def _texts(files: list[str] | None) -> Iterator[str]:
    for doc in train_documents(files=files):
        yield doc.text


def build_tokenizer(out_dir: str | Path, files: list[str] | None = None, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train on the corpus train split (or a subset of `files`) and save to `out_dir`."""
    tok = train_tokenizer(_texts(files), vocab_size)
    save_tokenizer(tok, out_dir)
    return tok
