"""Prefix reuse: a prompt that starts with tokens a cache slot holds skips their prefill, and the
output (tokens, and acceptance, which shows the drafter's context is the same) is what a full
prefill gives, for dense and hybrid targets."""

from __future__ import annotations

import json

import pytest
import torch

from flashtree import EngineConfig, LLMEngine, SamplingParams
from flashtree.engine.prefix_cache import MAX_STATES, PREFIX_BLOCK, PrefixCache
from flashtree.engine.runner import ModelRunner
from tiny import make_drafter, make_target

SYSTEM = [(7 * i + 3) % 13 + 1 for i in range(50)]  # a shared 50-token "system prompt"
PROMPTS = [SYSTEM + [2, 9, 4], SYSTEM + [5], SYSTEM + [2, 9, 4, 4, 1], SYSTEM[:20] + [11, 12], SYSTEM + [6, 6]]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    dense = make_target(root / "dense", vocab=16, logit_scale=3.0)
    from test_qwen3_5 import make_qwen35

    hybrid, _ = make_qwen35(root / "hybrid", vocab_size=16, logit_scale=4.0)
    layers = json.loads((hybrid / "config.json").read_text())
    return {
        "dense": (dense, make_drafter(root / "dd", target_layers=4, vocab=16, block_size=8)),
        "hybrid": (hybrid, make_drafter(root / "hd", target_layers=layers["num_hidden_layers"], vocab=16,
                                        hidden=layers["hidden_size"], block_size=8)),
    }


def engine(pair, prefix_cache: bool, method: str = "ddtree", **kw) -> LLMEngine:
    target, drafter = pair
    return LLMEngine(EngineConfig(target=str(target), drafter=None if method == "ar" else str(drafter), method=method,
                                  budget=16, device="cpu", dtype="float64", max_model_len=128,
                                  prefix_cache=prefix_cache, **{"max_batch": 2, **kw}))


def run_one_by_one(eng: LLMEngine, prompts, params):
    """Each prompt after the previous finished (so earlier prompts sit in free slots)."""
    out = []
    for p in prompts:
        req = eng.add_request(p, params)
        while not req.finished:
            eng.step()
        out.append(req)
    return out


def prefill_tokens(monkeypatch) -> list[int]:
    """Records the prompt tokens each runner.prefill call computes."""
    counted: list[int] = []
    original = ModelRunner.prefill

    def counting(self, req, end):
        counted.append(end - req.num_computed)
        return original(self, req, end)

    monkeypatch.setattr(ModelRunner, "prefill", counting)
    return counted


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_reuse_gives_the_same_output_and_skips_the_prefix(pairs, monkeypatch, kind, method):
    """Greedy tokens and per-round acceptance equal the no-reuse run; later prompts skip their
    shared prefix (dense: all of it but the last token; hybrid: from the second prompt on a state
    is saved at the block-aligned match, and the third reuses it)."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = run_one_by_one(engine(pairs[kind], False, method), PROMPTS, params)
    counted = prefill_tokens(monkeypatch)
    got = run_one_by_one(engine(pairs[kind], True, method), PROMPTS, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.stats.accept_lengths for r in got] == [r.stats.accept_lengths for r in ref]
    cached = [r.stats.cached_tokens for r in got]
    if kind == "dense":
        assert cached == [0, 50, 53, 20, 50]
    else:
        # 1st: nothing cached; 2nd: saves the state at 48 (its match with the 1st is 50 tokens);
        # 3rd and 5th reuse it; 4th matches only 20 tokens, below any saved state.
        assert cached == [0, 0, 48, 0, 48]
    assert sum(counted) == sum(len(p) for p in PROMPTS) - sum(cached)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_reuse_while_the_source_is_still_decoding(pairs, kind):
    """A request copies the prefix from a slot whose request is mid-decode (its prompt rows never
    change) and still matches the no-reuse output; both run batched."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def run(prefix_cache):
        eng = engine(pairs[kind], prefix_cache, max_batch=3)
        if kind == "hybrid":  # a state at the shared prefix, saved by an earlier pair of requests
            run_one_by_one(eng, PROMPTS[:2], SamplingParams(max_tokens=2, ignore_eos=True))
        first = eng.add_request(PROMPTS[0], params)
        for _ in range(3):
            eng.step()
        second = eng.add_request(PROMPTS[2], params)
        while eng.has_unfinished:
            eng.step()
        return first, second

    ref, got = run(False), run(True)
    assert got[1].stats.cached_tokens == (53 if kind == "dense" else 48)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.stats.accept_lengths for r in got] == [r.stats.accept_lengths for r in ref]


def test_sampled_output_is_the_same_with_reuse(pairs):
    """A seeded sample does not depend on whether its prefix was reused."""
    params = SamplingParams(temperature=0.9, top_k=8, seed=4, max_tokens=20, ignore_eos=True)
    ref = run_one_by_one(engine(pairs["dense"], False), PROMPTS[:3], params)
    got = run_one_by_one(engine(pairs["dense"], True), PROMPTS[:3], params)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]


def test_prompt_logprobs_requests_reuse_nothing(pairs):
    eng = engine(pairs["dense"], True)
    run_one_by_one(eng, PROMPTS[:1], SamplingParams(max_tokens=2))
    req = run_one_by_one(eng, PROMPTS[1:2], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert req.stats.cached_tokens == 0 and len(req.prompt_logprobs) == len(PROMPTS[1])


def test_slots_go_least_recently_used_first_and_a_match_prefers_the_own_slot():
    """choose_slot gives away the least recently used free slot; match takes the prefix from the
    new request's own slot when that holds the longest match (nothing to copy), else from any."""
    cache = PrefixCache(3, recurrent=False)
    cache.assign(0, [1, 2, 3, 4], 4)
    cache.assign(1, [1, 2, 3, 9], 4)
    cache.assign(2, [5, 5], 2)
    assert cache.choose_slot([2, 1, 0]) == 0
    cache.touch(0)
    assert cache.choose_slot([2, 1, 0]) == 1
    assert cache.match([1, 2, 3, 4, 8], 2).source == 0
    assert cache.match([1, 2, 3, 8], 1).source == 1  # slots 0 and 1 both hold [1, 2, 3]
    m = cache.match([1, 2, 3, 4], 2)
    assert (m.source, m.length) == (0, 3)  # the last token is always computed
    assert cache.match([7], 2) is None


def test_recurrent_states_are_bounded_and_looked_up_by_exact_prefix():
    cache = PrefixCache(1, recurrent=True)
    prompt = list(range(3 * PREFIX_BLOCK + 5))
    cache.assign(0, prompt, len(prompt))
    m = cache.match(prompt[: 2 * PREFIX_BLOCK + 3] + [999], 0)
    assert m.length == 0 and m.save_at == 2 * PREFIX_BLOCK
    cache.save_state(prompt[:PREFIX_BLOCK], "s16")
    m = cache.match(prompt[: 2 * PREFIX_BLOCK + 3] + [999], 0)
    assert (m.length, m.state, m.save_at) == (PREFIX_BLOCK, "s16", 2 * PREFIX_BLOCK)
    for i in range(MAX_STATES):
        cache.save_state([1000 + i], i)
    assert len(cache.states) == MAX_STATES and tuple(prompt[:PREFIX_BLOCK]) not in cache.states


def test_sliding_window_drafters_turn_reuse_off(tmp_path):
    target = make_target(tmp_path / "t", vocab=16)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=16, block_size=4,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    eng = engine((target, drafter), True)
    assert eng.prefix is None
    with torch.no_grad():
        run_one_by_one(eng, PROMPTS[:2], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("kind", ["dense", "hybrid", "sliding"])
def test_group_samples_copy_the_whole_prompt_state(pairs, tmp_path, kind):
    """n greedy samples, whose prompt K/V (hybrid: and recurrent state; sliding drafter: and
    ring) are copies of the first sample's, each decode exactly like a single request, with the
    same acceptance (so the drafter's copied context is the same too)."""
    pair = pairs.get(kind)
    if kind == "sliding":
        target = make_target(tmp_path / "t", vocab=16, logit_scale=3.0)
        pair = (target, make_drafter(tmp_path / "d", target_layers=4, vocab=16, block_size=4,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=8))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    single = run_one_by_one(engine(pair, False, max_batch=3), PROMPTS[:1], params)[0]
    eng = engine(pair, True, max_batch=3)
    group = eng.add_group(PROMPTS[0], SamplingParams(n=3, max_tokens=20, ignore_eos=True))
    while not group.finished:
        eng.step()
    for s in group.samples:
        assert s.output_ids == single.output_ids and s.stats.accept_lengths == single.stats.accept_lengths


@pytest.mark.slow
def test_tensor_parallel_ranks_reuse_their_own_prefixes(pairs, monkeypatch):
    """With tensor_parallel_size=2 every rank copies its own K/V slices and keeps its own saved
    recurrent states (the runner holds them by key), so a hybrid target's reuse and n > 1 copies
    give the single-rank tokens (FLASHTREE_TP_CHECK: the ranks agree after every call)."""
    monkeypatch.setenv("FLASHTREE_TP_CHECK", "1")
    import flashtree.parallel.workers as workers

    if workers._cluster is not None and not workers._cluster.check_results:
        workers._cluster.close()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = {}
    for tp in (1, 2):
        eng = engine(pairs["hybrid"], True, tensor_parallel_size=tp)
        reqs = run_one_by_one(eng, PROMPTS[:3], params)
        group = eng.add_group(PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))
        while not group.finished:
            eng.step()
        out[tp] = ([r.output_ids for r in reqs + group.samples], [r.stats.cached_tokens for r in reqs])
    assert out[2] == out[1] and out[2][1] == [0, 0, 48]
