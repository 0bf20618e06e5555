"""JSONL records shared by the pipeline stages: prompts in, regenerated sequences out.

A regenerated row is `{"id", "prompt_ids", "response_ids", ...}`. Training sees it as one
token sequence `prompt_ids + response_ids` with a loss mask that is 1 on the response only:
the drafter learns to draft what the *target* writes, never the prompt text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flashtree.errors import FlashtreeError


@dataclass
class TokenSequence:
    """One training sequence: ids, and 1 where the target produced the token."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, record) for every complete JSON line; a torn last line is skipped.

    A run killed mid-write leaves at most one partial line at the end, which resuming
    treats as not written.
    """
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError:
                if f.readline():  # something follows: real corruption, not a torn tail
                    raise FlashtreeError(f"{path}:{i + 1} is not valid JSON") from None
                return


def repair_jsonl(path: Path) -> None:
    """Drop a torn last line (left by a kill) so new rows can be appended safely."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data[:cut])
    os.replace(tmp, path)


def prompt_id(record: dict, line: int) -> str:
    return str(record.get("id", f"line-{line}"))


def read_sequences(path: str | os.PathLike) -> list[TokenSequence]:
    """Regenerated rows -> token sequences with a response-only loss mask."""
    out = []
    for line, rec in read_jsonl(path):
        if "input_ids" in rec:  # already a sequence (e.g. from another tool)
            ids = list(rec["input_ids"])
            mask = list(rec.get("loss_mask", [1] * len(ids)))
        else:
            try:
                p, r = list(rec["prompt_ids"]), list(rec["response_ids"])
            except KeyError:
                raise FlashtreeError(
                    f"{path}:{line + 1} needs prompt_ids + response_ids (from `flashtree train regenerate`) "
                    "or input_ids + loss_mask"
                ) from None
            ids, mask = p + r, [0] * len(p) + [1] * len(r)
        if len(ids) != len(mask):
            raise FlashtreeError(f"{path}:{line + 1}: input_ids and loss_mask differ in length")
        out.append(TokenSequence(prompt_id(rec, line), ids, mask))
    return out
