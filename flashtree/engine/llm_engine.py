"""LLMEngine: requests in, rounds out. The server and LLM.generate both drive this."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flashtree.config import EngineConfig
from flashtree.engine.prompts import encode_chat, max_prompt_chars
from flashtree.engine.runner import ModelRunner
from flashtree.engine.scheduler import Scheduler
from flashtree.engine.sequence import STAGES, Request, Status
from flashtree.errors import FlashtreeError, PromptTooLong
from flashtree.models.dflash import load_drafter
from flashtree.models.loader import eos_token_ids, load_target, parse_dtype
from flashtree.sampler import fresh_seed
from flashtree.sampling import SamplingParams


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclass
class RoundInfo:
    """Batch-level facts about the last step, for metrics."""

    batch_size: int
    seconds: float
    accept_lengths: list[int]
    modes: list[str] = field(default_factory=list)  # per request: the policy's choice (ar, chain, tree)
    draft_sizes: list[int] = field(default_factory=list)  # drafted nodes verified per request
    predicted_accepts: list[float] = field(default_factory=list)  # expected accepted drafted tokens


@dataclass
class EngineStats:
    """What a monitor may read about the engine (the server's /metrics gauges)."""

    waiting: int  # requests queued for a slot
    running: int  # requests holding a slot
    last_round: RoundInfo | None  # a new object after every batched round


def load_tokenizer(path):
    """The checkpoint's tokenizer (with its chat template), or None if it ships none."""
    from transformers import AutoTokenizer

    # Without tokenizer files, transformers 5 invents a default tokenizer; never use that.
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        return None
    # The engine enforces max_model_len itself; the tokenizer's own limit would only print a
    # warning ahead of the engine's clear error.
    tokenizer.model_max_length = 1 << 62
    return tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, share_weights: "LLMEngine | None" = None) -> None:
        """`share_weights`: an engine over the same checkpoints whose loaded modules to reuse, so
        several configurations (methods, budgets, limits) can run side by side without reloading;
        each engine still owns its KV caches. The bench drives its grid this way."""
        self.config = config
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = parse_dtype(config.dtype, device)
        self.device = device
        other = share_weights
        if other is not None and (other.config.target, other.device, other.dtype) != (config.target, device, dtype):
            raise FlashtreeError("share_weights needs an engine with the same target, device and dtype")
        self.dtype = dtype
        self.target = other.target if other is not None else load_target(config.target, dtype, device)
        self.drafter = None
        if config.method != "ar":
            if other is not None and other.drafter is not None and other.config.drafter == config.drafter:
                self.drafter = other.drafter
            else:
                self.drafter = load_drafter(config.drafter, self.target, dtype, device)
        limit = getattr(self.target.args, "max_position_embeddings", 4096)
        if config.max_model_len is None:
            config.max_model_len = min(limit, 4096)
        self.tokenizer = other.tokenizer if other is not None else load_tokenizer(self.target.source_dir)
        self.eos_ids = self._eos_ids()
        self.scheduler = Scheduler(config.max_batch, config.max_queue)
        self.runner = ModelRunner(config, self.target, self.drafter, device)
        self.last_round: RoundInfo | None = None

    def _eos_ids(self) -> set[int]:
        """The tokenizer's EOS and the checkpoint's (generation_config.json through transformers'
        GenerationConfig, and config.json)."""
        ids = eos_token_ids(self.target)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise FlashtreeError("this target ships no tokenizer; pass token id lists instead of text")
            # The tokenizer's own special tokens (Llama's BOS), unless the text already starts with
            # them, as a chat template renders it; token-id prompts are taken as given.
            bos = self.tokenizer.bos_token
            ids = self.tokenizer.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))
        else:
            ids = list(prompt)
        if not ids:
            raise FlashtreeError("the prompt is empty; give at least one token")
        vocab = self.target.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise FlashtreeError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def encode_chat(self, messages: list[dict], special_tokens: bool = False) -> list[int]:
        """Token ids of a chat (role/content dicts) through the target's chat template, ready for the
        assistant's turn. Special-token strings inside content stay text unless special_tokens."""
        return encode_chat(self.tokenizer, messages, special_tokens)

    def check_length(self, ids: list[int]) -> None:
        """Refuse a prompt that leaves no room for output (add_request does this too)."""
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise PromptTooLong(
                f"the prompt has {len(ids)} tokens but the context holds {limit} (prompt + output); "
                "shorten the prompt or raise max_model_len (--max-model-len)"
            )

    def check_size(self, chars: int) -> None:
        """Refuse, without tokenizing, a text of `chars` characters that no tokenization could fit
        in the context (bound: the vocabulary's longest token, with slack for Unicode normalizers)."""
        limit = self.config.max_model_len
        bound = max_prompt_chars(self.tokenizer, limit)
        if bound is not None and chars > bound:
            raise PromptTooLong(f"the prompt has {chars} characters; the context holds {limit} tokens, and "
                                f"prompts over {bound} characters are refused without tokenizing them")

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.waiting), len(s.running), self.last_round)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self.check_length(ids)
        req = Request(ids, params)
        if request_id is not None:
            req.request_id = request_id
        req.seed = fresh_seed() if params.seed is None else params.seed
        self.scheduler.add(req)
        return req

    def abort(self, req: Request) -> None:
        self.scheduler.finish(req, "abort")
        req.stats.finished = time.perf_counter()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Admit and prefill new requests, then run one batched round over the running ones."""
        outputs: list[StepOutput] = []
        for req in self.scheduler.admit():
            t0 = time.perf_counter()
            first = self.runner.prefill(req)
            req.stats.stage_seconds["prefill"] += time.perf_counter() - t0
            req.stats.first_token = time.perf_counter()
            outputs.append(self._emit(req, [first]))
        # Freshly prefilled requests join this round at once: they already hold a bonus token.
        running = sorted(self.scheduler.running, key=lambda r: r.slot)
        if not running:
            return outputs
        t0 = time.perf_counter()
        emitted, seconds = self.runner.step(running)
        elapsed = time.perf_counter() - t0
        plan = self.runner.last_plan
        modes = [plan.label(i) for i in range(len(running))]
        sizes = [plan.size(i) for i in range(len(running))]
        self.last_round = RoundInfo(len(running), elapsed, [len(e) for e in emitted], modes, sizes,
                                    list(plan.predicted))
        for i, (req, tokens) in enumerate(zip(running, emitted)):
            stats = req.stats
            stats.accept_lengths.append(len(tokens))
            stats.modes.append(modes[i])
            stats.draft_sizes.append(sizes[i])
            stats.predicted_accepts.append(plan.predicted[i])
            for name, s in seconds.items():
                stats.stage_seconds[name] += s
            outputs.append(self._emit(req, tokens))
        return outputs

    def _detokenize(self, req: Request, final: bool) -> str:
        """Text of the tokens not yet decoded, decoding only a short window (not the whole output).

        Decoding ids[prefix:] and subtracting ids[prefix:read] keeps tokenizers that drop a
        leading space at a sequence start right; a trailing partial UTF-8 character is held back
        until a later round completes it.
        """
        ids = req.output_ids
        decode = self.tokenizer.decode
        prefix_text = decode(ids[req.prefix_offset:req.read_offset], skip_special_tokens=True)
        full = decode(ids[req.prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd") and not final:
            return ""
        req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        return full[len(prefix_text):]

    def _emit(self, req: Request, tokens: list[int]) -> StepOutput:
        """Append a round's tokens, trimming exactly at EOS, stop ids, stop strings or limits."""
        params = req.params
        max_new = min(params.max_tokens, self.config.max_model_len - len(req.prompt_ids))
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        new: list[int] = []
        reason = None
        for t in tokens:
            if t in stop_ids:
                reason = "stop"
                break
            new.append(t)
            if len(req.output_ids) + len(new) >= max_new:
                reason = "length"
                break
        req.output_ids.extend(new)
        old_text = req.text
        if self.tokenizer is not None:
            text = req.text + self._detokenize(req, final=reason is not None)
            if params.stop:
                text, hit = trim_stop(text, params.stop, max(0, len(old_text) - max(map(len, params.stop))))
                if hit:
                    reason = "stop"
            req.text = text
        if reason is None:
            req.bonus = tokens[-1]
        else:
            self.scheduler.finish(req, reason)
            req.stats.finished = time.perf_counter()
        return StepOutput(req, new, req.finished)


def trim_stop(text: str, stops: list[str], search_from: int) -> tuple[str, bool]:
    """Cut text before the earliest stop string found at or after search_from."""
    hits = [i for s in stops if (i := text.find(s, search_from)) >= 0]
    if not hits:
        return text, False
    return text[: min(hits)], True


__all__ = ["LLMEngine", "StepOutput", "RoundInfo", "EngineStats", "STAGES", "Status"]
