"""Chunked prefill: a prompt prefilled in chunks of at most max_prefill_tokens gives the output and
caches of a one-piece prefill (dense and hybrid targets), and running requests keep their rounds
while a long prompt is admitted."""

from __future__ import annotations

import json

import pytest
import torch

from flashtree import EngineConfig, LLMEngine, SamplingParams
from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext
from tiny import make_drafter, make_target

LONG = [(5 * i + 1) % 15 + 1 for i in range(70)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    dense = make_target(root / "dense", vocab=16, logit_scale=3.0)
    from test_qwen3_5 import make_qwen35

    hybrid, _ = make_qwen35(root / "hybrid", vocab_size=16, logit_scale=4.0)
    layers = json.loads((hybrid / "config.json").read_text())
    return {
        "dense": (dense, make_drafter(root / "dd", target_layers=4, vocab=16, block_size=8)),
        "hybrid": (hybrid, make_drafter(root / "hd", target_layers=layers["num_hidden_layers"], vocab=16,
                                        hidden=layers["hidden_size"], block_size=8)),
    }


def engine(pair, chunk: int, **kw) -> LLMEngine:
    target, drafter = pair
    return LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), method="ddtree", budget=16, device="cpu",
                                  dtype="float64", max_model_len=160, max_prefill_tokens=chunk, prefix_cache=False,
                                  **{"max_batch": 3, **kw}))


def finish(eng: LLMEngine, prompts, params):
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished:
        eng.step()
    return reqs


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_chunked_output_and_caches_equal_one_piece(pairs, kind):
    """Greedy tokens and acceptance are those of a one-piece prefill for any chunk size, and
    right after the prefill the target cache (K/V; hybrid: recurrent state and conv window) and
    the drafter's context equal one-piece ones."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [LONG, LONG[:9], LONG[3:40]]
    ref = finish(engine(pairs[kind], 512), prompts, params)
    for chunk in (1, 7, 32):
        got = finish(engine(pairs[kind], chunk), prompts, params)
        assert [r.output_ids for r in got] == [r.output_ids for r in ref]
        assert [r.stats.accept_lengths for r in got] == [r.stats.accept_lengths for r in ref]

    caches = []
    for chunk in (512, 16):
        eng = engine(pairs[kind], chunk, max_batch=1)
        req = eng.add_request(LONG, params)
        while not req.prefilled:
            eng.step()
        runner = eng.runner
        n = len(LONG)
        state = [runner.cache.k[:, 0, :n], runner.cache.v[:, 0, :n], runner.draft_cache.k[:, 0, :n]]
        if kind == "hybrid":
            state += [runner.cache.state[:, 0], runner.cache.conv[:, 0]]
        caches.append([t.clone() for t in state])
    for one, chunked in zip(*caches):
        torch.testing.assert_close(chunked, one, rtol=1e-9, atol=1e-9)


def test_running_requests_keep_their_rounds_while_a_long_prompt_prefills(pairs):
    """Every step prefills one chunk of the waiting long prompt and also runs a round for the
    request already decoding; the step's prefill tokens never exceed max_prefill_tokens."""
    eng = engine(pairs["dense"], 16)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    running = eng.add_request([3, 4, 5], params)
    eng.step()
    long = eng.add_request(LONG, params)
    progress = []
    while not long.prefilled:
        before = len(running.output_ids)
        eng.step()
        assert len(running.output_ids) > before
        progress.append(long.num_computed)
    assert progress == [16, 32, 48, 64, 70]
    assert len(long.output_ids) >= 1  # its first round ran in the step that finished its prefill


def test_prefilling_requests_share_the_step_budget(pairs):
    """Two prompts admitted together: the step's chunks add up to max_prefill_tokens, the first
    seated prompt first."""
    eng = engine(pairs["dense"], 20)
    a = eng.add_request(LONG[:30], SamplingParams(max_tokens=4))
    b = eng.add_request(LONG[:25], SamplingParams(max_tokens=4))
    seen = []
    while not (a.prefilled and b.prefilled):
        eng.step()
        seen.append((a.num_computed, b.num_computed))
    assert seen == [(20, 0), (30, 10), (30, 25)]


def test_hybrid_chunks_continue_the_recurrence(pairs):
    """A hybrid target's prefill chunk starts from the state the previous chunk left: two halves
    give the one-piece logits."""
    eng = engine(pairs["hybrid"], 512, max_batch=2)
    model, cache = eng.target, eng.runner.cache
    ids = torch.tensor([LONG[:40]])
    with torch.no_grad():
        cache.set_length(0, 0)
        ctx = ForwardContext.prefill(cache, [0], 40)
        whole = model(ids, ctx).logits
        cache.commit(ctx, [40])
        cache.set_length(1, 0)
        parts = []
        for a, b in ((0, 25), (25, 40)):
            ctx = ForwardContext.prefill(cache, [1], b - a)
            parts.append(model(ids[:, a:b], ctx).logits)
            cache.commit(ctx, [b - a])
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-9, atol=1e-9)


def test_max_prefill_tokens_is_checked():
    with pytest.raises(FlashtreeError, match="max_prefill_tokens"):
        EngineConfig(max_prefill_tokens=0)
