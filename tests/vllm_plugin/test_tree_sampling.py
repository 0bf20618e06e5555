"""Sampling with DDTree inside vLLM follows the target's distribution (chi-square on the first two
tokens), and a seeded request gives the same tokens alone or in a batch.

Seeds are fixed (one per request), so the statistics are the same on every run and the test
cannot flake. The first token comes from vLLM's own sampler (the prefill step); the second from
flashtree's walk of the first tree.
"""
from collections import Counter

import pytest
import torch

pytest.importorskip("vllm")

from conftest import TARGET, close, engine, generate  # noqa: E402

from flashtree.sampler import probabilities  # noqa: E402
from flashtree.sampling import SamplingParams as FlashtreeParams  # noqa: E402

PROMPT = "def fibonacci(n):"
SAMPLES = 1500
CASES = [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 20}]


@pytest.fixture(scope="module")
def ddtree():
    # Whole prompts per step: vLLM 0.32's CPU runner fails on a seeded request whose prefill is chunked
    # ("CPU Generator does not use offset"), with or without trees.
    llm = engine(16, max_num_seqs=64, max_num_batched_tokens=4096)
    yield llm
    close(llm)


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float64).eval()
    return model, AutoTokenizer.from_pretrained(TARGET).encode(PROMPT, add_special_tokens=False)


def exact_bins(target, kw: dict) -> dict:
    """Expected probability of each (t1, t2) pair with at least 5 expected samples, each first token's
    remaining mass as (t1, None), and every other first token as (None, None)."""
    model, prompt = target
    params = FlashtreeParams(**kw)
    with torch.no_grad():
        first = probabilities(model(torch.tensor([prompt])).logits[0, -1], params)
        bins = {(None, None): 0.0}
        for t1 in range(first.shape[0]):
            p1 = float(first[t1])
            if SAMPLES * p1 < 5:
                bins[(None, None)] += p1
                continue
            second = probabilities(model(torch.tensor([prompt + [t1]])).logits[0, -1], params)
            bins[(t1, None)] = 0.0
            for t2 in range(second.shape[0]):
                p = p1 * float(second[t2])
                if SAMPLES * p < 5:
                    bins[(t1, None)] += p
                else:
                    bins[(t1, t2)] = p
    return bins


def chi_square_p(counts: Counter, bins: dict) -> float:
    observed, expected = [], []
    for (t1, t2), p in bins.items():
        if (t1, t2) == (None, None):
            observed.append(sum(n for (a, _), n in counts.items() if (a, None) not in bins))
        elif t2 is None:
            observed.append(sum(n for (a, b), n in counts.items() if a == t1 and (a, b) not in bins))
        else:
            observed.append(counts[(t1, t2)])
        expected.append(SAMPLES * p)
    obs, exp = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.slow
@pytest.mark.parametrize("kw", CASES, ids=["T1", "T0.8-topk20"])
def test_first_two_tokens_follow_the_target(ddtree, target, kw):
    """Pearson's chi-square of (first, second) token pairs over 1,500 seeded requests against the
    target's exact distribution (flashtree's definition of temperature and top-k, as vLLM's)."""
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=2, ignore_eos=True, seed=s, **kw) for s in range(SAMPLES)]
    outs = ddtree.generate([PROMPT] * SAMPLES, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    assert sum(counts.values()) == SAMPLES and all(len(k) == 2 for k in counts)
    steps = sum(len(o.outputs[0].spec_decode_metrics.per_step_accepted) for o in outs)
    assert steps == SAMPLES  # every second token came from a tree step
    assert chi_square_p(counts, exact_bins(target, kw)) > 1e-3


@pytest.mark.slow
def test_seeded_request_is_the_same_alone_and_in_a_batch(ddtree, demo_prompts):
    """flashtree's noise is keyed by (seed, position, token), so a seeded request's tokens do not depend
    on what else is in the batch."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, ignore_eos=True, seed=11)
    alone = [list(o.outputs[0].token_ids) for o in generate(ddtree, demo_prompts[:4], params, concurrency=1)]
    batched = [list(o.outputs[0].token_ids) for o in generate(ddtree, demo_prompts[:4], params)]
    assert alone == batched
