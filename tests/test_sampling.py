"""Sampled DFlash/DDTree output follows the target's exact sequence distribution (chi-square).

Seeds are fixed, so the statistics are the same on every run and the test cannot flake.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
import transformers
from scipy.stats import chisquare

from flashtree import LLM, SamplingParams
from flashtree import sampler
from flashtree.sampler import (SamplingBatch, SamplingStage, fresh_seed, gumbel_noise, mix32, pick, position_keys, probabilities,
                               processed_logprobs, seed_key)
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


def test_top_p_keeps_smallest_nucleus():
    probs = probabilities(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    probs = probabilities(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), SamplingParams(temperature=1.0, top_k=3))
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


# ---- the batched sampler against the definition -----------------------------------------------

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.9, seed=3),
    SamplingParams(temperature=0.5, top_p=0.6, top_k=40, seed=4),
    SamplingParams(temperature=2.0, top_p=0.99, seed=5),  # flat: the nucleus reaches past CANDIDATES
    SamplingParams(temperature=1.0, top_k=100_000, seed=6),  # top_k >= V is off
]


@pytest.fixture(params=["adaptive", "sync-free"])
def sampler_path(request, monkeypatch):
    """Both ways the sampler settles top-k/top-p: adaptive candidate levels with small host reads
    (the CPU's), and the read-free full ranking an accelerator uses, forced here on the CPU."""
    monkeypatch.setattr(sampler, "ADAPTIVE_ON_CPU", request.param == "adaptive")
    return request.param


def mixed_logits(V: int, seed: int = 0) -> torch.Tensor:
    """[R, N, V]: peaked rows, flat rows, and integer logits full of ties at every cutoff."""
    g = torch.Generator().manual_seed(seed)
    R, N = len(MIXED), 5
    logits = torch.randn(R, N, V, generator=g) * torch.tensor([4.0, 1.0, 0.3, 2.0, 6.0])[None, :, None]
    logits[:, 2] = torch.randint(0, 3, (R, V), generator=g).float()  # ties
    return logits


def scaled_top_k(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The definition's logits before softmax, written out independently of the sampler."""
    x = (logits - logits.amax(-1, keepdim=True)) * min(1 / p.temperature, torch.finfo(logits.dtype).max)
    if 0 < p.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[..., -1:], float("-inf"))
    return x


@pytest.mark.parametrize("V", [7, 3000])
def test_processed_logprobs_equal_the_definition(V, sampler_path):
    """processed_logprobs == log(probabilities) row by row, in a mixed batch (greedy rows: raw
    log_softmax), including rows whose nucleus needs the full-sort fallback and tied logits."""
    logits = mixed_logits(V)
    batch = SamplingBatch.build(MIXED, [p.seed or 0 for p in MIXED], torch.device("cpu"))
    lp = processed_logprobs(logits, batch)
    assert not lp.isnan().any()
    assert torch.equal(lp[0], torch.log_softmax(logits[0], -1))
    for r, p in enumerate(MIXED[1:], 1):
        ref = probabilities(logits[r], p)
        assert torch.allclose(lp[r].exp(), ref, atol=1e-6), r
        assert torch.equal(ref > 0, lp[r].exp() > 0), r  # the same kept set, exactly


@pytest.mark.parametrize("V", [7, 3000])
def test_pick_is_gumbel_max_over_the_definition(V, sampler_path):
    """pick (candidates, fallback, grouped rows) == argmax over the whole vocabulary of the
    definition's kept logits plus the (seed, position, token) noise; greedy rows == argmax."""
    logits = mixed_logits(V, seed=1)
    seeds = [p.seed or 0 for p in MIXED]
    batch = SamplingBatch.build(MIXED, seeds, torch.device("cpu"))
    positions = torch.tensor([0, 1, 1, 2, 2])[None].repeat(len(MIXED), 1) + 40 + torch.arange(len(MIXED))[:, None]
    picks = pick(logits, batch, positions)
    assert torch.equal(picks, pick(logits, batch, positions, span=3))
    assert torch.equal(picks[0], logits[0].argmax(-1))
    tokens = torch.arange(V)
    for r, p in enumerate(MIXED[1:], 1):
        keys = position_keys(torch.tensor([seed_key(p.seed)]), positions[r : r + 1])[0]
        noise = gumbel_noise(keys[:, None], tokens, torch.float32)
        kept = probabilities(logits[r], p) > 0
        want = (torch.where(kept, scaled_top_k(logits[r], p), float("-inf")) + noise).argmax(-1)
        assert torch.equal(picks[r], want), r


def test_noise_is_shared_by_position_not_by_node():
    """Nodes at one position draw the same noise: identical logits there give identical picks,
    and hashing once per position (span) gives exactly the per-node result."""
    g = torch.Generator().manual_seed(2)
    V = 50
    params = [SamplingParams(temperature=1.0, seed=9), SamplingParams(temperature=1.0, top_p=0.8, seed=10)]
    batch = SamplingBatch.build(params, [9, 10], torch.device("cpu"))
    depths = torch.tensor([[0, 1, 1, 1, 2, 2, 3, 1], [0, 1, 2, 1, 2, 3, 3, 1]])
    positions = torch.tensor([[11], [30]]) + depths
    logits = torch.randn(2, 1, V, generator=g).expand(2, 8, V) * 2  # the same distribution everywhere
    per_node = pick(logits, batch, positions)
    assert torch.equal(per_node, pick(logits, batch, positions, span=4))
    for r in range(2):
        for d in range(4):
            at_d = per_node[r][depths[r] == d]
            assert (at_d == at_d[0]).all()
    # Over many positions, one distribution is sampled faithfully (the hash is a good RNG).
    probs = torch.softmax(logits[0, 0], -1)
    positions = torch.arange(20_000)[None].repeat(2, 1)
    wide = logits[:, :1].expand(2, 20_000, V)
    for row, p in enumerate(params):
        counts = torch.bincount(pick(wide, batch, positions)[row], minlength=V).double()
        want = probabilities(logits[row, 0], p).double() * 20_000
        seen = want >= 5
        obs, exp = counts[seen].numpy(), want[seen].numpy()
        assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
        assert counts[~(want > 0)].sum() == 0  # never a dropped token


def test_wide_nuclei_fall_back_to_the_full_sort_exactly(sampler_path):
    """Flat rows whose top-p nucleus is wider than every candidate level: the full-sort fallback,
    hashed per node or per position, picks what Gumbel-max over the definition picks."""
    g = torch.Generator().manual_seed(6)
    V, N = 3000, 12
    logits = torch.randn(2, N, V, generator=g) * 0.3
    params = [SamplingParams(temperature=1.0, top_p=0.99, seed=1), SamplingParams(temperature=2.0, top_p=0.95, seed=2)]
    batch = SamplingBatch.build(params, [1, 2], torch.device("cpu"))
    positions = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])[None] + torch.tensor([[7], [19]])
    picks = pick(logits, batch, positions, span=4)
    assert torch.equal(picks, pick(logits, batch, positions))
    for r, p in enumerate(params):
        assert (probabilities(logits[r], p) > 0).sum(-1).min() > 1024  # wider than the candidates
        keys = position_keys(torch.tensor([seed_key(p.seed)]), positions[r : r + 1])[0]
        noise = gumbel_noise(keys[:, None], torch.arange(V), torch.float32)
        want = (torch.where(probabilities(logits[r], p) > 0, scaled_top_k(logits[r], p), float("-inf")) + noise).argmax(-1)
        assert torch.equal(picks[r], want)


def test_same_seed_same_pick_in_any_batch():
    """A row's pick depends on its own seed, logits and positions only, not on its batch mates."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 40, generator=g)
    positions = torch.arange(6)[None].repeat(4, 1) + torch.tensor([[3], [8], [5], [2]])
    params = [SamplingParams(temperature=0.9, top_k=7, top_p=0.8, seed=s) for s in (5, 6, 7, 8)]
    together = pick(logits, SamplingBatch.build(params, [5, 6, 7, 8], torch.device("cpu")), positions)
    mixed = [SamplingParams(), params[1], SamplingParams(temperature=1.0, seed=1), params[3]]
    with_others = pick(logits, SamplingBatch.build(mixed, [0, 6, 1, 8], torch.device("cpu")), positions)
    for r in range(4):
        alone = pick(logits[r : r + 1], SamplingBatch.build([params[r]], [5 + r], torch.device("cpu")), positions[r : r + 1])
        assert torch.equal(alone[0], together[r])
    assert torch.equal(with_others[[1, 3]], together[[1, 3]])
    other_seed = pick(logits, SamplingBatch.build(params, [50, 60, 70, 80], torch.device("cpu")), positions)
    assert not torch.equal(other_seed, together)


def test_hash_matches_uint32_arithmetic():
    """mix32 on int64 tensors and Python ints equals the wrapping uint32 finalizer, bit for bit."""
    x = np.random.default_rng(0).integers(0, 2**32, 10_000, dtype=np.uint64).astype(np.uint32)
    y = x ^ (x >> np.uint32(16))
    y = y * np.uint32(0x7FEB352D)
    y = y ^ (y >> np.uint32(15))
    y = y * np.uint32(0x846CA68B)
    y = y ^ (y >> np.uint32(16))
    assert np.array_equal(mix32(torch.from_numpy(x.astype(np.int64))).numpy(), y.astype(np.int64))
    assert [mix32(int(v)) for v in x[:50]] == [int(v) for v in y[:50]]
    t = torch.from_numpy(x.astype(np.int64))
    assert np.array_equal(sampler.mix32_tail_(t ^ (t >> 16), torch.empty_like(t)).numpy(), y.astype(np.int64))
    assert 0 <= fresh_seed() < 2**63 and len({fresh_seed() for _ in range(8)}) == 8



# ---- the noise against its first formula, bit for bit -------------------------------------------

BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


def reference_noise(pkeys: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The noise as first written, allocating op by op: every faster form must give its bits."""
    h = mix32(pkeys ^ mix32(tokens ^ 0x68E31DA4))
    w = ((h.float() + 0.5) * 2**-32).clamp(max=1 - 2**-24)
    return (-torch.log(-torch.log1p(-w))).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.mark.parametrize("V", [1, 7, 4096, 4099, 65537, 151936])
def test_noise_equals_the_first_formula(V):
    """gumbel_noise and vocab_noise (blocks of rows or of columns, cached token hashes, in place)
    give the first formula's bits for random keys and positions, in every target dtype."""
    g = torch.Generator().manual_seed(V)
    S = 40 if V <= 4099 else 2
    keys = torch.tensor([seed_key(int(s)) for s in torch.randint(0, 2**62, (S,), generator=g)])
    positions = torch.randint(0, 2**31, (S, 1), generator=g)
    pkeys = position_keys(keys, positions)  # [S, 1]
    ids = torch.randint(0, V, (S, 33), generator=g)
    for dtype in BITS:
        want = reference_noise(pkeys, torch.arange(V), dtype)
        assert same_bits(sampler.vocab_noise(pkeys, V, dtype), want), dtype
        assert same_bits(gumbel_noise(pkeys, torch.arange(V), dtype), want), dtype
        assert same_bits(gumbel_noise(pkeys, ids, dtype), reference_noise(pkeys, ids, dtype)), dtype


def unmix32(h: int) -> int:
    """mix32's inverse on one 32-bit int (each step is a bijection)."""
    h ^= h >> 16
    h = (h * pow(0x846CA68B, -1, 2**32)) & 0xFFFFFFFF
    h ^= (h >> 15) ^ (h >> 30)
    h = (h * pow(0x7FEB352D, -1, 2**32)) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_noise_at_the_edges_of_the_hash_range():
    """Token ids chosen so that the hash h (position key 0) is the smallest values, those around
    float32 rounding steps, and the top ones that the clamp catches: the first formula's bits."""
    hashes = [*range(0, 512), *range(2**24 - 256, 2**24 + 256), *range(2**31 - 256, 2**31 + 256),
              *range(2**32 - 1024, 2**32)]
    tokens = torch.tensor([unmix32(unmix32(h)) ^ 0x68E31DA4 for h in hashes])
    zero = torch.zeros(1, 1, dtype=torch.long)
    assert torch.equal(mix32(zero[0] ^ mix32(tokens ^ 0x68E31DA4)), torch.tensor(hashes))
    for dtype in BITS:
        assert same_bits(gumbel_noise(zero, tokens, dtype), reference_noise(zero, tokens, dtype)), dtype


def test_cached_token_hashes_do_not_leak_across_vocabularies_or_dtypes():
    """The token-hash cache is keyed by (V, device) and holds no dtype: alternating vocabularies and
    dtypes each get the first formula's noise, and each V its own table of V hashes."""
    pkeys = position_keys(torch.tensor([seed_key(3), seed_key(4)]), torch.tensor([[17], [900]]))
    for V, dtype in [(4099, torch.float64), (4096, torch.float32), (4099, torch.bfloat16), (7, torch.float32),
                     (4096, torch.float64), (4099, torch.float32)]:
        assert same_bits(sampler.vocab_noise(pkeys, V, dtype), reference_noise(pkeys, torch.arange(V), dtype))
        assert len(sampler.token_hashes(V, torch.device("cpu"))) == V
    assert sampler.token_hashes(4099, torch.device("cpu")) is sampler.token_hashes(4099, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_pick_adds_the_first_formulas_noise(dtype):
    """pick over many noise blocks (V = 4099, 80 nodes), hashed per node and per shared position,
    plain rows and a full-sort top-p row: argmax of the scaled kept logits plus the first formula's
    noise, in the compute dtype."""
    g = torch.Generator().manual_seed(11)
    V, N = 4099, 20
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=3.0, top_p=0.999, seed=3), SamplingParams(temperature=1.3, seed=4)]
    logits = (torch.randn(len(params), N, V, generator=g) * 3).to(dtype)
    depths = torch.randint(0, 7, (len(params), N), generator=g)
    positions = depths + torch.tensor([[5], [300], [41], [7000]])
    batch = SamplingBatch.build(params, [1, 2, 3, 4], torch.device("cpu"))
    per_node, per_position = pick(logits, batch, positions), pick(logits, batch, positions, span=7)
    assert torch.equal(per_node, per_position)
    x = logits.to(torch.promote_types(dtype, torch.float32))
    for r, p in enumerate(params):
        pkeys = position_keys(torch.tensor([seed_key(p.seed)]), positions[r : r + 1])[0][:, None]
        kept = torch.where(probabilities(x[r], p) > 0, scaled_top_k(x[r], p), float("-inf"))
        want = (kept + reference_noise(pkeys, torch.arange(V), x.dtype)).argmax(-1)
        assert torch.equal(per_node[r], want), r


TINY = [
    dict(temperature=1e-38), dict(temperature=1e-45), dict(temperature=5e-324),
    dict(temperature=1.0, top_p=1e-46), dict(temperature=1e-45, top_p=1e-46, top_k=3),
]


@pytest.mark.parametrize("kw", TINY)
def test_tiny_temperature_and_top_p_are_safe(kw):
    """No NaN anywhere, and the pick is the greedy limit: the argmax of the logits."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 9, 100, generator=g) * 3
    params = [SamplingParams(seed=1, **kw)] * 2
    batch = SamplingBatch.build(params, [1, 2], torch.device("cpu"))
    picks = pick(logits, batch, torch.arange(9)[None].repeat(2, 1))
    assert torch.equal(picks, logits.argmax(-1))
    assert not processed_logprobs(logits, batch).isnan().any()
    probs = probabilities(logits, params[0])
    assert not probs.isnan().any() and torch.equal(probs.argmax(-1), logits.argmax(-1))


def test_tiny_temperature_generates_the_greedy_text(pair):
    """End to end: temperature 1e-45 or top_p 1e-46 decodes the greedy text (no EOS by accident)."""
    target, drafter = pair
    llm = LLM(str(target), str(drafter), method="ddtree", budget=8, device="cpu", dtype="float32", max_model_len=32)
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    for kw in TINY:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, **kw))[0].token_ids
        assert out == greedy, kw


def test_top_p_cutoff_inside_tied_tokens_keeps_the_lowest_ids():
    """Ties at the cutoff go to the lower ids, as in the stable full sort, even though topk
    returns tied candidates in no particular order."""
    g = torch.Generator().manual_seed(5)
    V = 3000
    logits = torch.randn(1, 2, V, generator=g) * 0.1
    tied = torch.randperm(V, generator=g)[:20]
    logits[..., tied] = 10.0  # 20 tokens of ~0.0495 each: top_p 0.5 keeps 11 of them
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    batch = SamplingBatch.build([p], [3], torch.device("cpu"))
    kept = processed_logprobs(logits, batch)[0] > float("-inf")
    lowest = tied.sort().values[:11]
    for n in range(2):
        assert kept[n].nonzero()[:, 0].tolist() == lowest.tolist()
    picks = pick(logits[:, :1].expand(1, 400, V), batch, torch.arange(400)[None])
    assert set(picks[0].tolist()) == set(lowest.tolist())


def test_staged_batch_equals_a_fresh_one():
    """Parameters sent through the runner's reusable SamplingStage pick exactly as a fresh batch."""
    logits = mixed_logits(300, seed=7)
    seeds = [p.seed or 0 for p in MIXED]
    positions = torch.arange(5)[None].repeat(len(MIXED), 1) + 3
    stage = SamplingStage(16, torch.device("cpu"))
    fresh = pick(logits, SamplingBatch.build(MIXED, seeds, torch.device("cpu")), positions)
    pick(logits[:2], SamplingBatch.build(MIXED[2:4], seeds[2:4], torch.device("cpu"), stage), positions[:2])
    staged = pick(logits, SamplingBatch.build(MIXED, seeds, torch.device("cpu"), stage), positions)
    assert torch.equal(staged, fresh)
