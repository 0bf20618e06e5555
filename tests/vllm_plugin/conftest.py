"""Shared setup for the vLLM plugin tests: they run only where vLLM is installed (.ci/run builds
that venv), each engine in vLLM's own processes, on the demo pair with the DFlash-1 drafter."""
import gc
import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is not None:
    # vLLM's CPU build binds its OpenMP threads and sizes its KV cache from these; one core keeps
    # the engines from contending with each other and with the test process.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

DEMO = Path(__file__).resolve().parents[2] / "flashtree" / "assets" / "demo"
TARGET = str(DEMO / "target")
DRAFTER = str(DEMO / "drafter-dflash1")
DEPTH = 15  # the drafter's block - 1
SPEC = {"method": "dflash", "model": DRAFTER, "num_speculative_tokens": DEPTH}
# Every engine here batches at most this many tokens a step, so prompts longer than it take
# chunked prefill; it holds a B = 64 decode step (1 + 64 + 15 rows).
BATCHED = 128


def prompts(per_suite: int = 4) -> list[list[int]]:
    """The bench's held-out prompts as token ids, code then prose."""
    from transformers import AutoTokenizer

    from flashtree.bench.suites import load_suite

    tok = AutoTokenizer.from_pretrained(TARGET)
    return [p.token_ids or tok.encode(p.text, add_special_tokens=False)
            for s in ("code", "prose") for p in load_suite(s, per_suite)]


def engine(budget: int | None = None, speculative: bool = True, **kwargs):
    """A vLLM engine on the demo pair: AR (speculative=False), vLLM's DFlash chain (budget None) or DDTree."""
    from vllm import LLM

    if speculative:
        kwargs["speculative_config"] = dict(SPEC)
        kwargs.setdefault("per_request_spec_decode_metrics", "detailed")
    if budget is not None:
        kwargs["additional_config"] = {"ddtree": {"budget": budget}}
    kwargs.setdefault("max_num_batched_tokens", BATCHED)
    return LLM(model=TARGET, dtype="float32", max_model_len=1024, seed=0, enforce_eager=True, **kwargs)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm, token_ids: list[list[int]], params, concurrency: int | None = None):
    """Outputs in prompt order; concurrency 1 sends one prompt at a time, None all at once."""
    batches = [token_ids] if concurrency is None else [token_ids[i:i + concurrency]
                                                       for i in range(0, len(token_ids), concurrency)]
    outs = []
    for batch in batches:
        outs += llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    return outs


@pytest.fixture(scope="session")
def demo_prompts() -> list[list[int]]:
    return prompts()
