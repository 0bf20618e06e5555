"""LLM: the offline Python API over LLMEngine (same batching as the server)."""

from __future__ import annotations

from dataclasses import dataclass

from tqdm.auto import tqdm

from flashtree.config import EngineConfig
from flashtree.engine.llm_engine import LLMEngine
from flashtree.engine.sequence import Request, RequestGroup, RequestStats, TokenLogprob
from flashtree.errors import FlashtreeError
from flashtree.sampling import SamplingParams


@dataclass
class CompletionOutput:
    """One returned sample of a prompt."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None  # per token, with SamplingParams.logprobs
    cumulative_logprob: float
    stats: RequestStats

    @classmethod
    def of(cls, index: int, req: Request) -> CompletionOutput:
        return cls(index, req.output_ids, req.text, req.finish_reason or "", req.logprobs, req.cumulative_logprob,
                   req.stats)


@dataclass
class RequestOutput:
    """A prompt's result. token_ids, text, finish_reason and stats are its first output's;
    `outputs` has all n (best_of: the n best, best first)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @classmethod
    def of(cls, group: RequestGroup) -> RequestOutput:
        outputs = [CompletionOutput.of(i, r) for i, r in enumerate(group.choices())]
        first = outputs[0]
        return cls(group.request_id, group.prompt_ids, first.token_ids, first.text, first.finish_reason, first.stats,
                   outputs, group.samples[0].prompt_logprobs)


class LLM:
    """`LLM(target=..., drafter=..., method="ddtree", budget="auto").generate(prompts, params)`.

    With no target, the embedded demo pair is used. budget="auto" (the default) lets the
    speculation policy choose AR, the chain or a tree size per request and round; an int fixes it.
    """

    def __init__(self, target: str | None = None, drafter: str | None = None, method: str = "ddtree",
                 budget: int | str = "auto", device: str | None = None, dtype: str | None = None, **kwargs) -> None:
        self.config = EngineConfig(target=target, drafter=drafter, method=method, budget=budget,
                                   device=device, dtype=dtype, **kwargs)
        self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(params, list) and len(params) != len(prompts):
            raise FlashtreeError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one each")
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        engine = self.engine
        for p, sp in zip(prompts, plist):  # validate everything before any work starts
            engine.encode(p)
            if sp.num_samples > engine.config.max_batch:
                raise FlashtreeError(f"n/best_of = {sp.num_samples} needs that many cache slots; raise max_batch")
        pending = list(zip(prompts, plist))[::-1]
        groups: list[RequestGroup] = []
        with tqdm(total=len(pending), disable=not use_tqdm, desc="generate") as bar:
            while pending or any(not g.finished for g in groups):
                # Feed the bounded queue lazily so any number of prompts can be generated.
                while pending and (not engine.stats().waiting or
                                   engine.stats().waiting + pending[-1][1].num_samples <= engine.config.max_queue):
                    groups.append(engine.add_group(*pending.pop()))
                engine.step()
                bar.update(sum(g.finished for g in groups) - bar.n)
        return [RequestOutput.of(g) for g in groups]
