"""Sampled DFlash/DDTree output follows the target's exact sequence distribution (chi-square).

Seeds are fixed, so the statistics are the same on every run and the test cannot flake.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import transformers
from scipy.stats import chisquare

from flashtree import LLM, SamplingParams
from flashtree.sampler import probabilities
from tiny import make_drafter, make_target

VOCAB, LENGTH, SAMPLES = 4, 3, 2400
PROMPT = [1, 0, 2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target = make_target(root / "target", vocab=VOCAB, hidden=32, logit_scale=2.0, seed=3)
    drafter = make_drafter(root / "drafter", target_layers=4, vocab=VOCAB, block_size=4, mask_token_id=2, seed=4)
    return target, drafter


def exact_distribution(target, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(sequence) under the target's own sampling rule, from HF's logits."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    dist = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=LENGTH):
            ids = torch.tensor([PROMPT + list(seq)])
            logits = hf(ids).logits[0, len(PROMPT) - 1 : -1]
            probs = probabilities(logits, params)
            dist[seq] = float(torch.prod(probs[torch.arange(LENGTH), torch.tensor(seq)]))
    return dist


def sampled(target, drafter, method, budget, params_kw) -> Counter:
    llm = LLM(str(target), str(drafter), method=method, budget=budget, device="cpu", dtype="float64",
              max_batch=64, max_model_len=32)
    params = [SamplingParams(max_tokens=LENGTH, ignore_eos=True, seed=s, **params_kw) for s in range(SAMPLES)]
    outs = llm.generate([PROMPT] * SAMPLES, params)
    assert all(len(o.token_ids) == LENGTH for o in outs)
    return Counter(tuple(o.token_ids) for o in outs)


def chi_square_p(counts: Counter, dist: dict) -> float:
    """Pool outcomes with expected count < 5 into one bin, then Pearson's chi-square."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for seq, p in dist.items():
        if SAMPLES * p < 5:
            rest_o, rest_e = rest_o + counts[seq], rest_e + SAMPLES * p
        else:
            obs.append(counts[seq])
            exp.append(SAMPLES * p)
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


CASES = [
    ("dflash", 1, {"temperature": 1.0}),
    ("ddtree", 8, {"temperature": 1.0}),
    ("ddtree", 8, {"temperature": 1.0, "top_k": 2}),
    ("ddtree", 16, {"temperature": 1.5, "top_p": 0.9}),
    ("dflash", 1, {"temperature": 1.5, "top_p": 0.9, "top_k": 3}),
]


@pytest.mark.parametrize("method,budget,kw", CASES)
def test_sequence_distribution_matches_target(pair, method, budget, kw):
    target, drafter = pair
    dist = exact_distribution(target, SamplingParams(**kw))
    assert sum(SAMPLES * p >= 5 for p in dist.values()) >= 8, "too peaked to test anything"
    counts = sampled(target, drafter, method, budget, kw)
    assert chi_square_p(counts, dist) > 1e-3


def test_chi_square_has_power(pair):
    """The same samples are rejected against a different distribution, so the test above can fail."""
    target, drafter = pair
    counts = sampled(target, drafter, "ddtree", 8, {"temperature": 1.0})
    wrong = exact_distribution(target, SamplingParams(temperature=1.0, top_k=2))
    wrong = {k: v * 0.98 + 0.02 / len(wrong) for k, v in wrong.items()}
    assert chi_square_p(counts, wrong) < 1e-6


def test_seeded_requests_repeat():
    """The same seed gives the same sample stream (per-request generator)."""
    p = SamplingParams(temperature=1.0, seed=7)
    a = torch.softmax(torch.randn(5, 10, generator=torch.Generator().manual_seed(0)), -1)
    from flashtree.sampling import sample

    assert torch.equal(sample(a, p.generator(torch.device("cpu"))), sample(a, p.generator(torch.device("cpu"))))


def test_top_p_keeps_smallest_nucleus():
    probs = probabilities(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    probs = probabilities(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), SamplingParams(temperature=1.0, top_k=3))
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
