"""After every commit, target and drafter caches equal what AR-style prefill builds from the same tokens."""

from __future__ import annotations

import torch

from flashtree import EngineConfig, LLMEngine, SamplingParams
from tiny import make_drafter, make_target


def fresh_caches(engine: LLMEngine, tokens: list[int]):
    """Target K/V and drafter context K/V built by one causal prefill over `tokens`."""
    target, drafter = engine.target, engine.drafter
    n = len(tokens)
    tcache = target.new_cache(1, n + 1)
    out = target(torch.tensor([tokens]), torch.arange(n)[None], tcache.view([0]), None,
                 tuple(drafter.args.target_layer_ids))
    dcache = drafter.new_cache(1, n + 1)
    drafter.add_context(dcache.view([0]), out.features, [n])
    return tcache, dcache


def test_commit_matches_ar_cache(tmp_path):
    target = make_target(tmp_path / "t", vocab=16, logit_scale=3.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=16, block_size=8)
    engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), method="ddtree", budget=64,
                                    device="cpu", dtype="float64", max_batch=3, max_model_len=128))
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
    checked = deep = 0
    with torch.no_grad():
        while engine.has_unfinished:
            engine.step()
            for req in reqs:
                if req.finished:
                    continue
                # Committed = prompt + every emitted token except the bonus (next round's root).
                tokens = req.prompt_ids + req.output_ids[:-1]
                n = len(tokens)
                assert engine.runner.cache.lengths[req.slot] == n
                assert engine.runner.draft_cache.lengths[req.slot] == n
                tcache, dcache = fresh_caches(engine, tokens)
                cache, dc = engine.runner.cache, engine.runner.draft_cache
                assert torch.allclose(cache.k[:, req.slot, :n], tcache.k[:, 0, :n], atol=1e-10)
                assert torch.allclose(cache.v[:, req.slot, :n], tcache.v[:, 0, :n], atol=1e-10)
                assert torch.allclose(dc.k[:, req.slot, :n], dcache.k[:, 0, :n], atol=1e-10)
                assert torch.allclose(dc.v[:, req.slot, :n], dcache.v[:, 0, :n], atol=1e-10)
                checked += 1
                deep += bool(req.stats.accept_lengths) and req.stats.accept_lengths[-1] >= 3
    assert checked > 10 and deep > 0  # some rounds accepted a deep branch, so compaction moved K/V
