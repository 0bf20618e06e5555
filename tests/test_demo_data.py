"""Demo data invariants: stable disjoint split, lossless tokenizer, held-out-only prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flashtree.train import corpus
from flashtree.train.tokenizer import SPECIAL_TOKENS, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "flashtree" / "bench" / "prompts"
TARGET = REPO / "flashtree" / "assets" / "demo" / "target"
SAMPLE = "def f(x):\n\tif x:  # héllo ✓ 😀\n        return [x , 'a\\n']\r\n\n\n    \x00end  "


@pytest.fixture(scope="module")
def files() -> list[str]:
    all_files = corpus.list_files()
    held = [f for f in all_files if corpus.is_heldout(f)]
    return sorted(set(all_files[::25] + held[:6]))


def test_split_is_deterministic_and_disjoint(files: list[str]) -> None:
    # Pinned: the split is a fixed function of the path, not of run order or seed.
    assert corpus.is_heldout("socket.py") and corpus.is_heldout("statistics.py")
    assert not corpus.is_heldout("os.py") and not corpus.is_heldout("json/decoder.py")
    train = {d.path for d in corpus.train_documents(files=files)}
    held = {d.path for d in corpus.heldout_documents(files=files)}
    assert train and held and not train & held
    assert train | held <= set(files)
    assert all(not p.startswith(("test/", "idlelib/", "site-packages/")) for p in corpus.list_files())


def _check_tokenizer(path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3]
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.decode(tok(SAMPLE)["input_ids"]) == SAMPLE
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_roundtrip_and_specials(files: list[str], tmp_path: Path) -> None:
    build_tokenizer(tmp_path, files=files[:8], vocab_size=600)
    _check_tokenizer(tmp_path)


@pytest.mark.skipif(not (TARGET / "tokenizer.json").exists(), reason="demo target not built")
def test_shipped_tokenizer() -> None:
    _check_tokenizer(TARGET)


def test_prompt_suites_only_use_heldout_files(files: list[str]) -> None:
    for rows in corpus.build_prompt_suites(files=files, n=10).values():
        assert rows and all(corpus.is_heldout(r["source"]) for r in rows)


@pytest.mark.parametrize("name", ["code", "prose"])
def test_shipped_prompt_suites(name: str) -> None:
    rows = [json.loads(line) for line in (PROMPTS / f"{name}.jsonl").read_text().splitlines()]
    assert len(rows) >= 30 and len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert corpus.is_heldout(r["source"])
        assert corpus.PROMPT_MIN_CHARS <= len(r["prompt"]) <= corpus.PROMPT_MAX_CHARS
    if sys.version_info[:2] == (3, 11):  # the suites were cut from the 3.11 stdlib
        for r in rows[:10]:
            assert r["prompt"] in (corpus.stdlib_root() / r["source"]).read_text()
