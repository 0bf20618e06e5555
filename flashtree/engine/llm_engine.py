"""LLMEngine: requests in, rounds out. The server and LLM.generate both drive this."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flashtree.config import EngineConfig
from flashtree.engine.output import OutputProcessor
from flashtree.engine.pace import PaceWatch
from flashtree.engine.prefix_cache import PrefixCache
from flashtree.engine.prompts import encode_chat, max_prompt_chars
from flashtree.engine.runner import ModelRunner
from flashtree.engine.scheduler import Scheduler
from flashtree.engine.token_text import TokenText
from flashtree.engine.sequence import (STAGES, Request, RequestGroup, Status, TokenLogprob, derived_seed,
                                       new_request_id)
from flashtree.errors import FlashtreeError, PromptTooLong
from flashtree.models.dflash2 import load_drafter  # DFlash-1 or DFlash2, by architectures
from flashtree.models.loader import eos_token_ids, load_target, parse_dtype
from flashtree.models.mtp import load_head
from flashtree.sampler import fresh_seed
from flashtree.sampling import SamplingParams

if TYPE_CHECKING:
    from flashtree.parallel import EngineLink


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
    def __init__(self, config: EngineConfig, share_weights: "LLMEngine | None" = None,
                 tp: "EngineLink | None" = None) -> None:
        """`share_weights`: an engine over the same checkpoints whose loaded modules to reuse, so
        several configurations (methods, budgets, limits) can run side by side without reloading;
        each engine still owns its KV caches. The bench drives its grid this way.

        With config.tensor_parallel_size N > 1 this process is rank 0: the N - 1 worker
        processes (started on first use, flashtree.parallel.workers) build the same engine on
        their slices of the target while this one builds its own, and then follow its runner.
        `tp` is how a worker's engine learns its rank (an EngineLink); callers leave it None."""
        if tp is None and config.tensor_parallel_size > 1:
            from flashtree.parallel import open_engine

            with open_engine(self, config, share_weights) as tp:
                self._build(config, share_weights, tp)
        else:
            self._build(config, share_weights, tp)

    def _build(self, config: EngineConfig, share_weights: "LLMEngine | None", tp: "EngineLink | None") -> None:
        self.config = config
        self.tp = tp
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        device = tp.device if tp is not None else device  # a rank's own GPU (or the CPU)
        dtype = parse_dtype(config.dtype, device)
        self.device = device
        other = share_weights
        same = (config.target, device, dtype, config.tensor_parallel_size)
        if other is not None and (other.config.target, other.device, other.dtype,
                                  other.config.tensor_parallel_size) != same:
            raise FlashtreeError("share_weights needs an engine with the same target, device, dtype and "
                                 "tensor_parallel_size")
        self.dtype = dtype
        self.target = other.target if other is not None else load_target(config.target, dtype, device,
                                                                          tp=tp.group if tp is not None else None)
        limit = getattr(self.target.args, "max_position_embeddings", 4096)
        if config.max_model_len is None:
            config.max_model_len = min(limit, 4096)
        elif config.max_model_len > limit and not config.allow_long_max_model_len:
            raise FlashtreeError(f"max_model_len={config.max_model_len} is above the target's max_position_embeddings "
                                 f"({limit}); lower --max-model-len to at most {limit}, or pass "
                                 "--allow-long-max-model-len (allow_long_max_model_len=True) to use positions the "
                                 "model was not trained for")
        self.drafter = None
        mtp = config.method == "mtp"
        if config.method != "ar":
            # The drafter, or with method="mtp" the MTP head (each shared only with its own kind).
            source = (config.mtp_head or self.target.source_dir) if mtp else config.drafter
            shared = other is not None and other.drafter is not None and (other.config.method == "mtp") == mtp
            if shared and ((other.config.mtp_head or other.target.source_dir) if mtp else other.config.drafter) == source:
                self.drafter = other.drafter
            elif mtp:
                self.drafter = load_head(source, self.target, dtype, device, tp=tp.group if tp is not None else None)
            else:
                self.drafter = load_drafter(config.drafter, self.target, dtype, device)
        self.tokenizer = other.tokenizer if other is not None else load_tokenizer(self.target.source_dir)
        self.eos_ids = self._eos_ids()
        self.scheduler = Scheduler(config.max_batch, config.max_queue)
        self.output = OutputProcessor(self.tokenizer, self.eos_ids, config.max_model_len)
        self.runner = ModelRunner(config, self.target, self.drafter, device, progress=tp is None or tp.group.rank == 0)
        if tp is not None:  # all ranks take rank 0's start-up timings; rank 0's runner the workers then mirror
            self.runner = tp.attach(self.runner)
        self.prefix = self._prefix_cache()
        self._token_text: TokenText | None = None
        self._state_keys = itertools.count()  # names of recurrent states the runner keeps for the prefix cache
        self.last_round: RoundInfo | None = None
        self.pace = PaceWatch(device)

    def _prefix_cache(self) -> PrefixCache | None:
        caches = [self.runner.cache] + ([self.runner.draft_cache] if self.runner.draft_cache is not None else [])
        if not self.config.prefix_cache or not all(c.shares_prefixes for c in caches):
            return None  # off, or a sliding-window drafter (see flashtree/engine/prefix_cache.py)
        return PrefixCache(self.config.max_batch, recurrent=self.runner.cache.recurrent)

    def _eos_ids(self) -> set[int]:
        """The tokenizer's EOS and the checkpoint's (generation_config.json through transformers'
        GenerationConfig, and config.json)."""
        ids = eos_token_ids(self.target)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def capture_seconds(self) -> float:
        """Start-up seconds spent capturing rounds (compile=True); never part of a request."""
        return self.runner.capture_seconds

    def on_every_rank(self, fn, *args, rank0_kwargs: dict | None = None, **kwargs):
        """fn(engine, *args, **kwargs) on this engine and, under tensor parallelism, on every
        worker's copy of it at the same time: for work on the loaded models outside the round
        loop, whose sharded forwards need every rank (the bench's cost curve). fn must be a
        module-level function and the arguments picklable; `rank0_kwargs` (a progress callback)
        go to this process's call alone. Returns this process's result."""
        if self.tp is not None and self.tp.cluster is not None:
            self.tp.run(fn, args, kwargs)
        return fn(self, *args, **kwargs, **(rank0_kwargs or {}))

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

    def token_pieces(self, ids: list[int]) -> list[tuple[str, bytes]]:
        """Each token alone: its text and its exact bytes (how logprobs list tokens)."""
        if self.tokenizer is None:
            return [(f"token_id:{i}", f"token_id:{i}".encode()) for i in ids]
        if self._token_text is None:
            self._token_text = TokenText(self.tokenizer)
        return self._token_text.pieces(ids)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special tokens skipped), e.g. a token-id prompt to echo."""
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.waiting), len(s.running), self.last_round)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """Queue one sample of a prompt (n = 1, no best_of); add_group takes any n."""
        params = params or SamplingParams()
        if params.num_samples > 1:
            raise FlashtreeError("add_request makes one sample; use add_group for n > 1 or best_of")
        ids = self.encode(prompt)
        self.check_length(ids)
        req = self._sample(ids, params, request_id or new_request_id(), 0)
        self.scheduler.add(req)
        return req

    def add_group(self, prompt: str | list[int], params: SamplingParams | None = None,
                  request_id: str | None = None) -> RequestGroup:
        """Queue params.best_of (or n) samples of one prompt. They are seated together and share
        one prefill: the first sample computes the prompt, the others copy its K/V. Sample i is
        request `{request_id}-{i}` (just request_id when there is one sample), seeded with
        derived_seed(seed, i) when params.seed is set."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self.check_length(ids)
        k = params.num_samples
        if k > self.config.max_batch:
            raise FlashtreeError(f"n/best_of = {k} samples need {k} cache slots at once, but this engine has "
                                 f"max_batch={self.config.max_batch}; ask for fewer or raise max_batch (--max-batch)")
        gid = request_id or new_request_id()
        samples = [self._sample(ids, params, gid if k == 1 else f"{gid}-{i}", i) for i in range(k)]
        group = RequestGroup(gid, ids, params, samples)
        for s in samples:
            s.group = group
        self.scheduler.add(samples)
        return group

    def _sample(self, ids: list[int], params: SamplingParams, request_id: str, index: int) -> Request:
        req = Request(ids, params, request_id=request_id, index=index)
        req.seed = fresh_seed() if params.seed is None else derived_seed(params.seed, index)
        # best_of ranks samples by cumulative logprob, so it needs them even when not asked.
        if params.logprobs is not None or params.num_samples > params.n:
            req.logprobs = []
        if params.prompt_logprobs is not None and index == 0:
            req.prompt_logprobs = [None]
        return req

    def abort(self, req: Request | RequestGroup) -> None:
        """End a request; a sample of a group ends its whole group (one client request)."""
        group = req if isinstance(req, RequestGroup) else req.group
        now = time.perf_counter()
        for s in group.samples if group is not None else [req]:
            if not s.finished:
                self.scheduler.finish(s, "abort")
                s.stats.finished = now

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Seat waiting requests, prefill up to max_prefill_tokens of prompts, then run one batched
        round over every request that holds its next root."""
        outputs: list[StepOutput] = []
        for req in self.scheduler.admit(self._choose_slot):
            self._seat(req)
        self._prefill(outputs)
        # Requests whose prefill just ended join this round at once: they already hold a bonus token.
        running = sorted(self.scheduler.decoding(), key=lambda r: r.slot)
        if not running:
            return outputs
        t0 = time.perf_counter()
        emitted, seconds, logprobs = self.runner.step(running)
        elapsed = time.perf_counter() - t0
        plan = self.runner.last_plan
        modes = [plan.label(i) for i in range(len(running))]
        sizes = [plan.size(i) for i in range(len(running))]
        self.last_round = RoundInfo(len(running), elapsed, [len(e) for e in emitted], modes, sizes,
                                    list(plan.predicted))
        self.pace.observe(elapsed, plan.seconds)
        for i, (req, tokens, lps) in enumerate(zip(running, emitted, logprobs)):
            stats = req.stats
            stats.accept_lengths.append(len(tokens))
            stats.modes.append(modes[i])
            stats.draft_sizes.append(sizes[i])
            stats.predicted_accepts.append(plan.predicted[i])
            for name, s in seconds.items():
                stats.stage_seconds[name] += s
            outputs.append(self._emit(req, tokens, lps))
        return outputs

    # ---- seating and prefill --------------------------------------------------------------

    def _choose_slot(self, req: Request, free: list[int]) -> int:
        return free[-1] if self.prefix is None else self.prefix.choose_slot(free)

    def _seat(self, req: Request) -> None:
        """Start a seated request's slot: empty, or holding the longest prefix the cache has."""
        if not req.prefills:
            return  # a group's other samples copy the first one's prompt when it is done
        match = None
        if self.prefix is not None and req.prompt_logprobs is None:
            match = self.prefix.match(req.prompt_ids, req.slot)
        length = match.length if match is not None else 0
        # Seated requests are all running now: a burst on an idle engine joins one batch.
        self.runner.admit(req, self.scheduler.running)
        length = self.runner.seat(req.slot, match.source if length else None, length,
                                  match.state if length else None, req.speculative)
        req.num_computed = req.stats.cached_tokens = length
        req.save_state_at = match.save_at if match is not None else None
        if self.prefix is not None:
            self.prefix.assign(req.slot, req.prompt_ids, length)

    def _prefill(self, outputs: list[StepOutput]) -> None:
        """One chunk for each prefilling request while the step's max_prefill_tokens last."""
        budget = self.config.max_prefill_tokens
        for req in self.scheduler.prefilling():
            if budget == 0:
                break
            start = req.num_computed
            end = min(len(req.prompt_ids), start + budget)
            if req.save_state_at is not None and start < req.save_state_at < end:
                end = req.save_state_at
            budget -= end - start
            t0 = time.perf_counter()
            self.runner.prefill(req, end)
            req.num_computed = end
            if self.prefix is not None:
                self.prefix.extend(req.slot, end)
                if end == req.save_state_at:
                    key = next(self._state_keys)
                    self.runner.save_state(req.slot, key)
                    for old in self.prefix.save_state(req.prompt_ids[:end], key):
                        self.runner.drop_state(old)
            req.stats.stage_seconds["prefill"] += time.perf_counter() - t0
            if req.prefilled:
                outputs.extend(self._start(req))

    def _start(self, first: Request) -> list[StepOutput]:
        """The prompt is in: the group's other samples get copies of it, then every sample draws
        its first token from the prompt's last logits."""
        t0 = time.perf_counter()
        samples = [s for s in (first.group.samples if first.group is not None else [first]) if not s.finished]
        tokens, logprobs = self.runner.start_samples(samples)
        now = time.perf_counter()
        outputs = []
        for s, token, lp in zip(samples, tokens, logprobs):
            if s is not first:
                s.num_computed = len(s.prompt_ids)
                s.stats.stage_seconds["prefill"] += now - t0
                if self.prefix is not None:
                    self.prefix.assign(s.slot, s.prompt_ids, s.num_computed)
            s.stats.first_token = now
            outputs.append(self._emit(s, [token], lp))
        return outputs

    # ---- output ---------------------------------------------------------------------------

    def _emit(self, req: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> StepOutput:
        """Append a round's tokens (trimmed at EOS, stop ids, stop strings, limits); finish on a stop."""
        new, reason = self.output.append(req, tokens, logprobs)
        if reason is None:
            req.bonus = tokens[-1]
        else:
            self.scheduler.finish(req, reason)
            req.stats.finished = time.perf_counter()
            if self.prefix is not None:
                self.prefix.touch(req.slot)
        return StepOutput(req, new, req.finished)


__all__ = ["LLMEngine", "StepOutput", "RoundInfo", "EngineStats", "STAGES", "Status", "RequestGroup", "TokenLogprob"]
