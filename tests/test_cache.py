"""After every commit, target and drafter caches equal what AR-style prefill builds from the same
tokens: K/V for a dense target; K/V, recurrent state and conv window for a hybrid one."""

from __future__ import annotations

import json

import pytest
import torch

from flashtree import EngineConfig, LLMEngine, SamplingParams
from flashtree.models.context import ForwardContext
from tiny import make_drafter, make_target


def fresh_caches(engine: LLMEngine, tokens: list[int]):
    """Target cache and drafter context K/V built by one causal prefill over `tokens`."""
    target, drafter = engine.target, engine.drafter
    n = len(tokens)
    tcache = target.new_cache(1, n + 1)
    ctx = ForwardContext.prefill(tcache, [0], n)
    out = target(torch.tensor([tokens]), ctx, tuple(drafter.args.target_layer_ids))
    tcache.commit(ctx, [n])
    dcache = drafter.new_cache(1, n + 1)
    dctx = ForwardContext.block(dcache, [0], n)
    drafter.add_context(dctx, out.features)
    dcache.commit(dctx, [n])
    return tcache, dcache


def pair(tmp_path, kind: str):
    if kind == "dense":
        target = make_target(tmp_path / "t", vocab=16, logit_scale=3.0)
        return target, make_drafter(tmp_path / "d", target_layers=4, vocab=16, block_size=8)
    from test_qwen3_5 import make_qwen35

    target, _ = make_qwen35(tmp_path / "t", vocab_size=16, logit_scale=4.0)
    text = json.loads((target / "config.json").read_text())
    return target, make_drafter(tmp_path / "d", target_layers=text["num_hidden_layers"], vocab=16,
                                hidden=text["hidden_size"], block_size=8)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_commit_matches_ar_cache(tmp_path, kind):
    target, drafter = pair(tmp_path, kind)
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
                if kind == "hybrid":
                    assert torch.allclose(cache.state[:, req.slot], tcache.state[:, 0], atol=1e-9)
                    assert torch.allclose(cache.conv[:, req.slot], tcache.conv[:, 0], atol=1e-10)
                assert torch.allclose(dc.k[:, req.slot, :n], dcache.k[:, 0, :n], atol=1e-10)
                assert torch.allclose(dc.v[:, req.slot, :n], dcache.v[:, 0, :n], atol=1e-10)
                checked += 1
                deep += bool(req.stats.accept_lengths) and req.stats.accept_lengths[-1] >= 3
    assert checked > 10 and deep > 0  # some rounds accepted a deep branch, so compaction moved K/V
