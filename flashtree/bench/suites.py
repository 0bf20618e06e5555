"""Prompt suites for the bench: the project's own, any JSONL file, and the standard hub sets.

The project's suites (prompts/code.jsonl, prompts/prose.jsonl) are held out from the demo pair's
training data, so they measure acceptance on text the drafter has not memorised. The standard
suites come through `datasets` when online; without it, or offline with nothing cached, they fail
with one clear line instead of a retry storm.
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from flashtree.errors import FlashtreeError

PROMPT_DIR = Path(__file__).parent / "prompts"
BUILTIN = ("code", "prose")


@dataclass
class Prompt:
    id: str
    suite: str
    text: str | None = None  # raw text (continuation prompt, or a user turn when chat)
    token_ids: list[int] | None = None  # ready token ids (JSONL "prompt_ids"): no tokenizer needed
    chat: bool = False  # a user instruction: wrap in the target's chat template when it has one


@dataclass(frozen=True)
class HubSuite:
    """Where a standard suite lives on the hub and how to read a row's user turn."""

    path: str
    config: str | None
    split: str
    text: Callable[[dict], str]


def _alpaca(row: dict) -> str:
    return row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")


STANDARD: dict[str, HubSuite] = {
    "gsm8k": HubSuite("openai/gsm8k", "main", "test", lambda r: r["question"]),
    "math500": HubSuite("HuggingFaceH4/MATH-500", None, "test", lambda r: r["problem"]),
    "humaneval": HubSuite("openai/openai_humaneval", None, "test", lambda r: r["prompt"]),
    "mbpp": HubSuite("google-research-datasets/mbpp", "full", "test", lambda r: r["text"]),
    "mt-bench": HubSuite("HuggingFaceH4/mt_bench_prompts", None, "train", lambda r: r["prompt"][0]),
    "alpaca": HubSuite("tatsu-lab/alpaca", None, "train", _alpaca),
}


def suite_names() -> list[str]:
    return [*BUILTIN, *STANDARD]


def load_suite(name: str, limit: int | None = None) -> list[Prompt]:
    """The first `limit` prompts of a suite: a built-in name, a standard name, or a .jsonl path."""
    if name in BUILTIN:
        return read_jsonl(PROMPT_DIR / f"{name}.jsonl", name, limit)
    if name in STANDARD:
        return load_standard(name, limit)
    path = Path(name).expanduser()
    if path.suffix == ".jsonl" or path.is_file():
        if not path.is_file():
            raise FlashtreeError(f"no such prompt file: {path}")
        return read_jsonl(path, path.stem, limit)
    raise FlashtreeError(f"unknown suite {name!r}; choose from {', '.join(suite_names())} or give a .jsonl file")


def read_jsonl(path: Path, suite: str, limit: int | None = None) -> list[Prompt]:
    """Rows with "prompt" (text) or "prompt_ids" (token ids), optional "id" and "chat"."""
    prompts = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(prompts) >= limit:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise FlashtreeError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            text, ids = row.get("prompt"), row.get("prompt_ids")
            if not isinstance(text, str) and not (isinstance(ids, list) and ids):
                raise FlashtreeError(f"{path}:{line_no}: a row needs a 'prompt' string or a 'prompt_ids' list")
            pid = str(row.get("id", f"{suite}-{len(prompts):03d}"))
            prompts.append(Prompt(pid, suite, text if ids is None else None, ids, bool(row.get("chat", False))))
    if not prompts:
        raise FlashtreeError(f"{path} holds no prompts")
    return prompts


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the hub, so an offline run fails in seconds, not after retries."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


@contextmanager
def offline_hub():
    """Run `datasets` in offline mode (cached copies only, no retries) for the duration."""
    import huggingface_hub.constants as hub
    import datasets.config as ds

    saved = (hub.HF_HUB_OFFLINE, ds.HF_HUB_OFFLINE, ds.HF_DATASETS_OFFLINE)
    hub.HF_HUB_OFFLINE = ds.HF_HUB_OFFLINE = ds.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, ds.HF_HUB_OFFLINE, ds.HF_DATASETS_OFFLINE = saved


def load_standard(name: str, limit: int | None = None) -> list[Prompt]:
    spec = STANDARD[name]
    try:
        import datasets
    except ImportError:
        raise FlashtreeError(
            f"suite {name!r} is loaded through the `datasets` package, which is not installed; "
            "pip install datasets (or use the built-in suites: code, prose)"
        ) from None
    split = spec.split if limit is None else f"{spec.split}[:{limit}]"
    mode = nullcontext() if hub_reachable() else offline_hub()
    try:
        datasets.logging.set_verbosity_error()
        with mode:
            rows = datasets.load_dataset(spec.path, spec.config, split=split)
    except Exception as e:  # offline, renamed, gated: all end the same way for the user
        raise FlashtreeError(
            f"could not load suite {name!r} ({spec.path}) through `datasets` ({type(e).__name__}); "
            "it needs the network once (or a cached copy); the built-in suites code and prose work offline"
        ) from None
    return [Prompt(f"{name}-{i:03d}", name, spec.text(row), None, True) for i, row in enumerate(rows)]
