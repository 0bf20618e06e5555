"""CPU linear layers (float32, bfloat16) through oneDNN's packed weights (flashtree/models/packed.py): the products equal
F.linear's to float32 rounding, a pack is made once and again only after its weight is written,
an engine packs by default and keeps AR's tokens, and the ways packing is refused are one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashtree import LLM, EngineConfig, LLMEngine, SamplingParams
from flashtree.errors import FlashtreeError
from flashtree.models import packed
from flashtree.models.layers import Linear, MergedLinear
from tests.tiny import make_drafter, make_target

pytestmark = pytest.mark.skipif(not packed.available(), reason="this PyTorch build has no oneDNN")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 1, 24), (1, 17, 24), (3, 5, 24), (40, 24)])
def test_packed_products_equal_f_linear(shape, dtype, tol):
    """One row (F.linear itself in float32, packed in bfloat16), a window, a batch of windows and a
    flat batch, with a bias, and a merged projection's row slice (what the drafter's context K/V
    multiplies by): F.linear's products to the dtype's rounding."""
    torch.manual_seed(0)
    lin = Linear(24, 48, bias=True).to(dtype)
    merged = MergedLinear(24, [("q_proj", 16), ("k_proj", 8), ("v_proj", 8)], bias=True).to(dtype)
    x = torch.randn(*shape).to(dtype)
    want, want_kv = lin(x), merged.project(x, "k_proj", "v_proj")
    packed.pack_linears([lin, merged], True)
    assert lin.packed and merged.packed
    torch.testing.assert_close(lin(x), want, rtol=tol, atol=tol)
    torch.testing.assert_close(merged.project(x, "k_proj", "v_proj"), want_kv, rtol=tol, atol=tol)
    torch.testing.assert_close(merged.fused(x), F.linear(x, merged.weight, merged.bias), rtol=tol, atol=tol)


def test_a_pack_is_made_once_and_again_after_its_weight_is_written():
    lin = Linear(8, 8)
    packed.pack_linears([lin], True)
    first = packed.packed_rows(lin.weight, 0, 8)
    assert packed.packed_rows(lin.weight, 0, 8) is first
    x = torch.randn(4, 8)
    with torch.no_grad():
        lin.weight.mul_(2.0)
    assert packed.packed_rows(lin.weight, 0, 8) is not first
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_a_model_built_under_inference_mode_packs():
    """Weights created under torch.inference_mode keep no version counter; they pack all the same."""
    with torch.inference_mode():
        lin = Linear(8, 8)
        assert packed.pack_linears([lin], True)
        x = torch.randn(3, 8)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return (str(make_target(root / "target", vocab=32, logit_scale=3.0)),
            str(make_drafter(root / "drafter", target_layers=4, vocab=32, block_size=8)))


def test_an_engine_packs_by_default_and_keeps_ar_tokens_and_logprobs(pair):
    """On the CPU in float32 the target's and drafter's linears are packed unless asked not to; a
    tree engine's tokens are AR's, and the logprobs equal an unpacked engine's to float32 rounding."""
    prompts = [[1, 2, 3], list(range(1, 20))]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for pack, method in ((False, "ar"), (None, "ar"), (None, "ddtree")):
        llm = LLM(*pair, method=method, budget=16, device="cpu", max_batch=2, max_model_len=128, pack_weights=pack)
        assert llm.engine.runner.packed == (pack is None)
        assert llm.engine.runner.target.lm_head.packed == (pack is None)
        runs[pack, method] = llm.generate(prompts, params)
    plain, ar, tree = runs[False, "ar"], runs[None, "ar"], runs[None, "ddtree"]
    assert [o.token_ids for o in tree] == [o.token_ids for o in ar] == [o.token_ids for o in plain]
    for a, b in zip(ar, plain):
        assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-4)


def test_packing_is_refused_in_one_line(pair, monkeypatch, capsys):
    """A pack_weights that is not a bool or None, and pack_weights=True without oneDNN, are one
    FlashtreeError each; unset, it quietly runs F.linear. Short of memory for the copies, unset
    skips them with one line."""
    with pytest.raises(FlashtreeError, match="pack_weights must be True, False or None"):
        LLM(*pair, device="cpu", pack_weights="yes")
    monkeypatch.setattr(packed, "available", lambda: False)
    with pytest.raises(FlashtreeError, match="pack_weights=True needs PyTorch's oneDNN"):
        packed.pack_linears([Linear(8, 8)], True)
    assert not packed.pack_linears([Linear(8, 8)], None)
    monkeypatch.undo()
    monkeypatch.setattr(packed, "free_memory", lambda: 1024)
    lin = Linear(64, 64)
    assert not packed.pack_linears([lin], None) and not lin.packed
    assert "not packed for oneDNN" in capsys.readouterr().err


def test_engines_sharing_weights_share_one_packing_decision(pair):
    """Engines over shared modules (share_weights) multiply alike: an unset pack_weights follows the
    first engine's decision, modules the first one lacked (a drafter) get it too, and asking for the
    opposite is one FlashtreeError."""
    target, drafter = pair
    first = LLMEngine(EngineConfig(target=target, method="ar", device="cpu", max_model_len=64, pack_weights=False))
    follower = LLMEngine(EngineConfig(target=target, drafter=drafter, method="dflash", device="cpu", max_model_len=64),
                         share_weights=first)
    assert not follower.runner.packed and not follower.drafter.fc.packed
    with pytest.raises(FlashtreeError, match="shared with an engine that did not pack them"):
        LLMEngine(EngineConfig(target=target, method="ar", device="cpu", max_model_len=64, pack_weights=True),
                  share_weights=first)
    packed_first = LLMEngine(EngineConfig(target=target, method="ar", device="cpu", max_model_len=64))
    assert packed_first.runner.packed
    with pytest.raises(FlashtreeError, match="shared with an engine that packed them"):
        LLMEngine(EngineConfig(target=target, method="ar", device="cpu", max_model_len=64, pack_weights=False),
                  share_weights=packed_first)
