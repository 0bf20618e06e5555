"""budget="auto": trees cut to the size that measured cost says pays off, still exact and lossless."""

from __future__ import annotations

import torch

from flashtree import LLM, EngineConfig, LLMEngine, SamplingParams
from flashtree.engine.budget import AutoBudget
from flashtree.tree import build_tree
from flashtree.tree.budget import expected_accepts, truncate
from tiny import make_drafter, make_target


def test_truncate_equals_building_smaller():
    """Cutting a budget-40 tree to b nodes gives exactly the budget-b tree (ties included)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        D, V = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
        logits = torch.randn(3, D, V, generator=g) * 3
        if trial % 4 == 0:
            logits = logits.round()  # exact ties
        big = build_tree(torch.tensor([1, 2, 3]), logits, 40)
        for b in (1, 2, 5, 13, 39):
            cut, ref = truncate(big, b), build_tree(torch.tensor([1, 2, 3]), logits, b)
            for field in ("tokens", "parents", "depths", "sizes", "scores"):
                assert torch.equal(getattr(cut, field), getattr(ref, field)), (trial, b, field)


def test_expected_accepts_is_the_sum_of_prefix_probabilities():
    logits = torch.log(torch.tensor([[[0.6, 0.3, 0.1], [0.5, 0.25, 0.25]]]))
    spec = build_tree(torch.tensor([0]), logits, 4)
    got = expected_accepts(spec)[0]
    # prefixes by probability: (0)=.6, (1)=.3, (0,0)=.3, (0,1)=.15
    assert torch.allclose(got, torch.tensor([0.6, 0.9, 1.2, 1.35]), atol=1e-6)


def test_choice_follows_cost():
    """Flat verify cost favours the biggest useful tree; steep cost favours a small one."""
    expected = [[min(b, 20) * 0.1 for b in range(1, 65)]]  # each node worth 0.1 token, up to 20 nodes
    flat = AutoBudget(64, {n: 0.010 for n in (1, 2, 65)}, draft_seconds=0.002)
    assert flat.choose(expected, 64) >= 16
    steep = AutoBudget(64, {1: 0.010, 2: 0.012, 65: 0.600}, draft_seconds=0.002)
    assert steep.choose(expected, 64) <= 2
    steep.observe(predicted=1.0, accepted=3)
    assert steep.calibration > 1.0


def test_auto_budget_is_lossless(tmp_path):
    target = make_target(tmp_path / "t", vocab=16, logit_scale=3.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=16, block_size=8)
    prompts = [[1, 2, 3], [4, 5], list(range(1, 13))]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = LLM(str(target), None, method="ar", device="cpu", max_model_len=128).generate(prompts, params)
    llm = LLM(str(target), str(drafter), method="ddtree", budget="auto", max_budget=64, device="cpu",
              max_model_len=128, max_batch=2)
    assert llm.engine.runner.auto is not None
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    # The startup measurement left every slot empty.
    assert LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), budget="auto", max_budget=16,
                                  device="cpu", max_model_len=64)).runner.cache.lengths == [0] * 8


def test_auto_budget_on_hybrid_target(tmp_path):
    """The startup measurement resets recurrent state too: output still equals AR."""
    from test_qwen3_5 import make_qwen35

    target, _ = make_qwen35(tmp_path / "t", logit_scale=3.0)
    cfg = __import__("json").loads((target / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    drafter = make_drafter(tmp_path / "d", target_layers=text["num_hidden_layers"], vocab=text["vocab_size"],
                           hidden=text["hidden_size"], block_size=6)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6]]
    ref = LLM(str(target), None, method="ar", device="cpu", max_model_len=96).generate(prompts, params)
    out = LLM(str(target), str(drafter), method="ddtree", budget="auto", max_budget=32, device="cpu",
              max_model_len=96).generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
