"""Regenerate the training responses with the target itself.

The drafter should predict what the target writes, not what a dataset's author wrote:
training on the target's own outputs is what makes its drafts get accepted. Generation goes
through the flashtree engine (its continuous batching, and DDTree once a drafter exists;
`method="ar"` bootstraps the first drafter). Rows are appended chunk by chunk, so a rerun
skips every id already written. Several temperatures (e.g. 0, 0.7 and 1) mix greedy and sampled
responses, so a drafter also learns what the target writes when it samples: by default prompt n
is answered at temperature n mod k (as many responses as prompts, the cost of one temperature);
with `each_temperature`, every prompt at every temperature (ids "ID@tT").
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from flashtree.engine.prompts import encode_chat
from flashtree.errors import FlashtreeError
from flashtree.train.data import prompt_id, read_jsonl, repair_jsonl


@dataclass
class RegenerateConfig:
    prompts: str  # JSONL: {"messages": [...]} | {"prompt": "..."} | {"prompt_ids": [...]}, optional "id"
    out: str  # JSONL of {"id", "prompt_ids", "response_ids", "finish_reason"}
    target: str | None = None  # None = the embedded demo target
    drafter: str | None = None
    method: str = "ddtree"  # "ar" when no drafter exists yet
    budget: int = 64
    temperature: float | list[float] = 0.0  # a list: a mix (prompt n at temperature[n % len])
    each_temperature: bool = False  # a list: every prompt at every temperature instead (ids "ID@tT")
    top_p: float = 1.0
    max_tokens: int = 256
    chat_template: bool = False  # wrap prompts in the target tokenizer's chat template
    chunk: int = 64  # prompts per LLM.generate call (and per append to `out`)
    max_batch: int = 16  # requests the engine decodes together
    limit: int | None = None  # first N prompts only
    seed: int = 0
    device: str | None = None
    dtype: str | None = None


def encode_prompt(record: dict, tokenizer, chat: bool) -> list[int]:
    """Token ids of one prompt record, with or without the chat template."""
    if "prompt_ids" in record:
        return list(record["prompt_ids"])
    if tokenizer is None:
        raise FlashtreeError("this target ships no tokenizer; give prompts as {\"prompt_ids\": [...]}")
    if "messages" in record:
        messages = list(record["messages"])
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]  # the dataset's answer is what we regenerate
        if not chat:
            raise FlashtreeError("prompts with \"messages\" need the chat template; pass --chat-template")
    elif "prompt" in record:
        if not chat:
            return tokenizer.encode(record["prompt"], add_special_tokens=False)
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise FlashtreeError("each prompt line needs \"messages\", \"prompt\" or \"prompt_ids\"")
    if not getattr(tokenizer, "chat_template", None):
        raise FlashtreeError("--chat-template needs a target tokenizer with a chat template")
    return encode_chat(tokenizer, messages)


def done_ids(out: Path) -> set[str]:
    if not out.is_file():
        return set()
    repair_jsonl(out)
    return {str(rec["id"]) for _, rec in read_jsonl(out)}


def regenerate(cfg: RegenerateConfig, llm=None) -> dict:
    """Write the target's responses for every prompt not yet in `cfg.out`; returns counts."""
    from flashtree import LLM, SamplingParams

    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = done_ids(out)
    records = [(prompt_id(rec, line), rec) for line, rec in read_jsonl(cfg.prompts)]
    if cfg.limit is not None:
        records = records[: cfg.limit]
    ids = [i for i, _ in records]
    if len(set(ids)) != len(ids):
        raise FlashtreeError(f"{cfg.prompts} has duplicate ids; resuming needs each prompt's id to be unique")
    temps = list(cfg.temperature) if isinstance(cfg.temperature, (list, tuple)) else [cfg.temperature]
    if not temps or any(t < 0 for t in temps) or len(set(temps)) != len(temps):
        raise FlashtreeError(f"temperatures must be distinct and >= 0, got {temps}")
    if cfg.each_temperature and len(temps) > 1:  # one job per (prompt, temperature)
        jobs = [(n, j, f"{i}@t{t:g}", rec, t) for n, (i, rec) in enumerate(records) for j, t in enumerate(temps)]
    else:  # one job per prompt, temperatures taken in turn; ids stay the prompts' own
        jobs = [(n, 0, i, rec, temps[n % len(temps)]) for n, (i, rec) in enumerate(records)]
    todo = [job for job in jobs if job[2] not in done]
    stats = {"prompts": len(records), "responses": len(jobs), "skipped": len(jobs) - len(todo), "written": 0,
             "tokens": 0}
    if not todo:
        return stats
    if llm is None:
        llm = LLM(target=cfg.target, drafter=cfg.drafter, method=cfg.method, budget=cfg.budget,
                  device=cfg.device, dtype=cfg.dtype, max_batch=cfg.max_batch)
    limit = llm.config.max_model_len - 1
    t0 = time.perf_counter()
    with open(out, "a", encoding="utf-8") as f, tqdm(total=len(jobs), initial=stats["skipped"],
                                                      desc="regenerate", unit="response") as bar:
        for c in range(0, len(todo), cfg.chunk):
            chunk = todo[c : c + cfg.chunk]
            prompts = [encode_prompt(rec, llm.tokenizer, cfg.chat_template)[-limit:] for _, _, _, rec, _ in chunk]
            # A seed per prompt and temperature: a resumed run samples what an uninterrupted one would have.
            params = [SamplingParams(temperature=t, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                                     seed=cfg.seed * 1_000_003 + n + 7919 * j) for n, j, _, _, t in chunk]
            outs = llm.generate(prompts, params)
            for (_, _, pid, _, t), prompt, o in zip(chunk, prompts, outs):
                row = {"id": pid, "prompt_ids": prompt, "response_ids": o.token_ids, "temperature": t,
                       "finish_reason": o.finish_reason, "tau": round(o.stats.mean_accept_length, 3)}
                f.write(json.dumps(row) + "\n")
                stats["tokens"] += len(o.token_ids)
            f.flush()
            os.fsync(f.fileno())
            stats["written"] += len(chunk)
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{stats['tokens'] / (time.perf_counter() - t0):.0f}")
    return stats
