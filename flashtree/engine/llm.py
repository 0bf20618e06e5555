"""LLM: the offline Python API over LLMEngine (same batching as the server)."""

from __future__ import annotations

from dataclasses import dataclass

from tqdm.auto import tqdm

from flashtree.config import EngineConfig
from flashtree.engine.llm_engine import LLMEngine
from flashtree.engine.sequence import RequestStats
from flashtree.errors import FlashtreeError
from flashtree.sampling import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats


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
        for p in prompts:  # validate everything before any work starts
            engine.encode(p)
        pending = list(zip(prompts, plist))[::-1]
        reqs = []
        with tqdm(total=len(pending), disable=not use_tqdm, desc="generate") as bar:
            while pending or any(not r.finished for r in reqs):
                # Feed the bounded queue lazily so any number of prompts can be generated.
                while pending and len(engine.scheduler.waiting) < engine.config.max_queue:
                    reqs.append(engine.add_request(*pending.pop()))
                for out in engine.step():
                    if out.finished:
                        bar.update(1)
        return [
            RequestOutput(r.request_id, r.prompt_ids, r.output_ids, r.text, r.finish_reason or "", r.stats)
            for r in reqs
        ]
