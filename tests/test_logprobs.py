"""Logprobs, n > 1 and best_of.

Every returned logprob equals an HF transformers forward of the demo target over prompt + output
within 1e-4 in float32, for ar, dflash and ddtree: output tokens under the request's
temperature/top-k/top-p, prompt tokens under the plain log-softmax. n samples share one prefill; seeded sample i draws what a request seeded
derived_seed(seed, i) draws; best_of returns the n samples with the highest cumulative logprob.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import flashtree
from flashtree import LLM, EngineConfig, LLMEngine, SamplingParams
from flashtree.config import DEMO_TARGET
from flashtree.engine.runner import ModelRunner
from flashtree.engine.sequence import derived_seed
from flashtree.sampler import probabilities

PROMPT = "def fibonacci(n):\n    "
GREEDY = SamplingParams(max_tokens=24, logprobs=5, prompt_logprobs=3, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=5, max_tokens=24, logprobs=5, prompt_logprobs=3,
                         ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llms():
    return {m: LLM(method=m, budget=16, device="cpu", dtype="float32", max_batch=4) for m in ("ar", "dflash", "ddtree")}


def reference(hf, ids: list[int], params: SamplingParams) -> torch.Tensor:
    """Log-probs [len(ids), V] of the distribution at each position (predicting the next token)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    if params.greedy:
        return torch.log_softmax(logits, -1)
    return probabilities(logits, params).log()


def check(entry, ref_row: torch.Tensor, k: int) -> None:
    assert abs(entry.logprob - ref_row[entry.token].item()) < 1e-4
    values = ref_row.topk(k).values
    values = values[values > float("-inf")]  # filtered-out tokens are not listed
    assert len(entry.top) == len(values)
    for (token, lp), want in zip(entry.top, values.tolist()):
        assert abs(lp - want) < 1e-4 and abs(ref_row[token].item() - lp) < 1e-4


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "t0.7-topk-topp"])
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_logprobs_equal_an_hf_forward_of_the_target(hf, llms, method, params):
    out = llms[method].generate([PROMPT], params)[0]
    ids = out.prompt_token_ids + out.token_ids
    ref = reference(hf, ids, params)
    n = len(out.prompt_token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 24
    for j, entry in enumerate(out.logprobs):
        assert entry.token == out.token_ids[j]
        check(entry, ref[n + j - 1], 5)
    assert math.isclose(out.outputs[0].cumulative_logprob, sum(e.logprob for e in out.logprobs), abs_tol=1e-9)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    plain = reference(hf, ids, GREEDY)  # prompt tokens are scored by the plain log-softmax
    for j in range(1, n):
        assert out.prompt_logprobs[j].token == ids[j]
        check(out.prompt_logprobs[j], plain[j - 1], 3)


def test_methods_return_the_same_tokens_and_logprobs(llms):
    """Same tokens (greedy, and seeded sampling) and the same logprobs across methods."""
    for params in (GREEDY, SAMPLED):
        outs = {m: llm.generate([PROMPT], params)[0] for m, llm in llms.items()}
        ar = outs.pop("ar")
        for out in outs.values():
            assert out.token_ids == ar.token_ids
            for a, b in zip(out.logprobs, ar.logprobs):
                assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_round_with_logprobs_still_reads_the_device_once(monkeypatch):
    """The logprobs ride in the round's one read: `tolist` is the only device read of a round.
    The tree builders' CPU-only early stop (flashtree/tree/, off on other devices) reads host
    values on purpose and is not counted, as in tests/test_host_reads.py."""
    engine = LLMEngine(EngineConfig(method="ddtree", budget=16, device="cpu", max_batch=2))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, logprobs=3, ignore_eos=True))
    engine.add_request([8, 9], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    reads = []
    original = torch.Tensor.tolist

    tree_dir = str(Path(flashtree.__file__).parent / "tree")

    def counting(t):
        if not sys._getframe(1).f_code.co_filename.startswith(tree_dir):
            reads.append(tuple(t.shape))
        return original(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    for _ in range(3):
        reads.clear()
        engine.step()
        assert len(reads) == 1


def test_n_samples_share_one_prefill_and_greedy_choices_are_identical(monkeypatch):
    calls = []
    original = ModelRunner.prefill
    monkeypatch.setattr(ModelRunner, "prefill", lambda self, req, end: calls.append(end - req.num_computed)
                        or original(self, req, end))
    llm = LLM(method="ddtree", budget=16, device="cpu", dtype="float32", max_batch=4, prefix_cache=False)
    out = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=16, ignore_eos=True))[0]
    assert calls == [len(out.prompt_token_ids)]  # the prompt was computed once
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(o.token_ids == out.token_ids for o in out.outputs)


def test_seeded_samples_use_derived_seeds(llms):
    """Sample i of a group seeded s draws exactly what one request seeded derived_seed(s, i)
    draws; sample 0 is the plain seeded request, and the samples differ."""
    base = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    llm = llms["ddtree"]
    out = llm.generate([PROMPT], SamplingParams(n=3, seed=11, **base))[0]
    singles = [llm.generate([PROMPT], SamplingParams(seed=derived_seed(11, i), **base))[0].token_ids for i in range(3)]
    assert [o.token_ids for o in out.outputs] == singles
    assert derived_seed(11, 0) == 11 and len({tuple(s) for s in singles}) == 3
    assert derived_seed(11, 1) != derived_seed(12, 0) and derived_seed(11, 1) != derived_seed(11, 2)


def test_best_of_returns_the_n_highest_cumulative_logprobs():
    engine = LLMEngine(EngineConfig(method="ddtree", budget=16, device="cpu", max_batch=4))
    group = engine.add_group(engine.encode(PROMPT), SamplingParams(n=2, best_of=4, temperature=1.0, seed=3,
                                                                   max_tokens=12, ignore_eos=True))
    while not group.finished:
        engine.step()
    scores = [s.cumulative_logprob for s in group.samples]
    assert len(set(scores)) == 4
    assert [s.cumulative_logprob for s in group.choices()] == sorted(scores, reverse=True)[:2]
    for s in group.samples:  # best_of keeps logprobs even when the request did not ask for them
        assert math.isclose(s.cumulative_logprob, sum(e.logprob for e in s.logprobs), abs_tol=1e-9)


def test_groups_need_their_slots_at_once():
    engine = LLMEngine(EngineConfig(method="ar", device="cpu", max_batch=2))
    with pytest.raises(Exception, match="max_batch"):
        engine.add_group([1, 2], SamplingParams(n=3))
    with pytest.raises(Exception, match="add_group"):
        engine.add_request([1, 2], SamplingParams(n=2))

