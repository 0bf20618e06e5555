"""A round reads the device exactly once (the accepted counts and tokens), for every method (mtp too), a fixed
and an auto budget, dense and hybrid targets, greedy and sampled requests together.

On the CPU every tensor is a host tensor, so the test counts the calls that would read a device
tensor back (tolist, item, bool/int/float/index conversions, numpy, cpu) and the ops that sync
implicitly on CUDA (nonzero, unique, masked_select, boolean-mask indexing), made while
`ModelRunner.step` runs. The tree builder's CPU-only early stop reads host scalars on purpose (it
is off on other devices), so calls made from flashtree/tree/ are not counted. Where CUDA exists,
the same rounds also run under torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from flashtree import EngineConfig, LLMEngine, SamplingParams, sampler
from flashtree.engine.runner import ModelRunner
from flashtree.models.loader import read_config, text_config
from flashtree.models.mtp import build_head, save_head
from tiny import make_drafter, make_target

TREE_DIR = str(Path(__file__).resolve().parents[1] / "flashtree" / "tree")
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")
IMPLICIT_SYNCS = ("nonzero", "unique", "masked_select")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from test_qwen3_5 import make_qwen35

    root = tmp_path_factory.mktemp("reads")
    dense = make_target(root / "dense", vocab=32, logit_scale=3.0)
    hybrid, _ = make_qwen35(root / "hybrid", logit_scale=3.0)
    text = json.loads((hybrid / "config.json").read_text())
    for target in (dense, hybrid, root / "wide"):  # a random MTP head for method="mtp"
        if target.name == "wide":
            make_target(target, vocab=300, logit_scale=3.0)
        save_head(build_head(text_config(read_config(target))), target / "head", target)
    return {
        "dense": (dense, make_drafter(root / "dd", target_layers=4, vocab=32, block_size=6)),
        "wide": (root / "wide", make_drafter(root / "wd", target_layers=4, vocab=300, block_size=6)),
        "hybrid": (hybrid, make_drafter(root / "hd", target_layers=text["num_hidden_layers"],
                                        vocab=text["vocab_size"], hidden=text["hidden_size"], block_size=6)),
    }


class ReadCounter:
    """Counts host reads and implicit syncs made outside flashtree/tree/ while `active`."""

    def __init__(self, monkeypatch) -> None:
        self.active = False
        self.calls: list[str] = []
        self.suspended = False  # MaskIndexing re-enters a counted method it was dispatched from
        for name in READS + IMPLICIT_SYNCS:
            self._wrap(monkeypatch, torch.Tensor, name)
        for name in IMPLICIT_SYNCS:
            self._wrap(monkeypatch, torch, name)
        self._wrap(monkeypatch, torch, "tensor", label="torch.tensor (a host-to-device copy)")
        # Explicit waits for the device are host reads too (a stage clock's syncs were once).
        self._wrap(monkeypatch, torch.cuda, "synchronize", label="torch.cuda.synchronize")
        for owner in (torch.cuda.Stream, torch.cuda.Event):
            self._wrap(monkeypatch, owner, "synchronize", label=f"{owner.__name__}.synchronize")

    def _wrap(self, monkeypatch, owner, name: str, label: str | None = None) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if self.active and not self.suspended and self._outside_tree():
                self.calls.append(label or name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    @staticmethod
    def _outside_tree() -> bool:
        return not sys._getframe(2).f_code.co_filename.startswith(TREE_DIR)


class MaskIndexing(TorchFunctionMode):
    """Counts boolean-mask indexing. A torch-function mode rather than a patch of
    torch.Tensor.__getitem__: that patch cannot be undone (CPython leaves a sequence slot on the
    class, and torch.tensor() of a list of 0-d tensors then fails in later tests)."""

    def __init__(self, counter: ReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.Tensor.__getitem__ and self.counter.active and _has_bool_index(args[1])
                and not sys._getframe(1).f_code.co_filename.startswith(TREE_DIR)):
            self.counter.calls.append("boolean-mask indexing")
        if getattr(func, "__name__", None) != "counted":
            return func(*args, **(kwargs or {}))
        self.counter.suspended = True  # the counted wrapper that dispatched here already counted
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.counter.suspended = False


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@pytest.mark.parametrize("shapes", ["exact", "static", "captured"])
@pytest.mark.parametrize("kind", ["dense", "hybrid", "wide"])
@pytest.mark.parametrize("method,budget", [("ar", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", "auto"), ("mtp", 1)])
def test_a_round_reads_the_device_once(pairs, monkeypatch, kind, method, budget, shapes):
    """static: shapes padded to buckets (3 requests -> 4 rows, the 4th on the dummy slot);
    captured: capture=True, rounds replayed from start-up captures (budget="auto": one per arm).
    wide: V = 300, past the sampler's first candidate level, on the sampler path an accelerator
    takes (the CPU's own path may read a few masks to settle top-p, where reads are free)."""
    if kind == "wide":
        monkeypatch.setattr(sampler, "ADAPTIVE_ON_CPU", False)
    target, drafter = pairs[kind]
    engine = LLMEngine(EngineConfig(target=str(target), drafter=None if method in ("ar", "mtp") else str(drafter),
                                    method=method, budget=budget, max_budget=16, device="cpu", max_batch=3,
                                    max_model_len=96, static_shapes=shapes == "static",
                                    capture=shapes == "captured", mtp_head=str(target / "head")))
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request([7, 8], SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=3, max_tokens=30,
                                              ignore_eos=True))
    engine.add_request([9, 10, 11], SamplingParams(max_tokens=30, ignore_eos=True))  # 3 rows: padded to 4
    engine.step()  # admission and prefill (not a round's business), then the first round

    counter = ReadCounter(monkeypatch)
    with MaskIndexing(counter):
        counter.active = True  # the counter itself sees reads and implicit syncs
        torch.ones(2).sum().item()
        torch.ones(3)[torch.ones(3, dtype=torch.bool)]
        counter.active = False
        assert counter.calls == ["item", "boolean-mask indexing"]
    per_round = reads_per_round(engine, counter, monkeypatch, 3)
    assert len(per_round) == 3
    for calls in per_round:
        assert calls == ["tolist"], calls


def reads_per_round(engine: LLMEngine, counter: ReadCounter, monkeypatch, rounds: int) -> list[list[str]]:
    """The reads and implicit syncs of each of the next `rounds` engine steps' ModelRunner.step
    (run inside a MaskIndexing mode, so boolean-mask indexing counts too)."""
    per_round: list[list[str]] = []
    original_step = ModelRunner.step

    def counted_step(self, reqs):
        counter.calls, counter.active = [], True
        try:
            return original_step(self, reqs)
        finally:
            counter.active = False
            per_round.append(counter.calls)

    monkeypatch.setattr(ModelRunner, "step", counted_step)
    with MaskIndexing(counter):
        for _ in range(rounds):
            engine.step()
    return per_round


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("method,budget", [("ar", 1), ("dflash", 1), ("ddtree", 16), ("ddtree", "auto"), ("mtp", 1)])
def test_cuda_round_has_no_implicit_sync(pairs, monkeypatch, method, budget, captured):
    """The one read is the round's end; anything else that synchronises raises, and with stage
    timing left at its default no stage clock waits for the device."""
    target, drafter = pairs["dense"]
    engine = LLMEngine(EngineConfig(target=str(target), drafter=None if method in ("ar", "mtp") else str(drafter),
                                    method=method, budget=budget, max_budget=16, device="cuda", dtype="float32",
                                    max_batch=3, max_model_len=96, capture=captured, mtp_head=str(target / "head")))
    waits = []
    for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                        (torch.cuda.Event, "synchronize")):
        original_wait = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _o=original_wait, **k: (waits.append(1), _o(*a, **k))[1])
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    running = sorted(engine.scheduler.running, key=lambda r: r.slot)
    original = torch.Tensor.tolist
    try:
        torch.Tensor.tolist = lambda t: (torch.cuda.set_sync_debug_mode(0), original(t))[1]
        for _ in range(3):
            torch.cuda.set_sync_debug_mode("error")
            engine.runner.step(running)
    finally:
        torch.Tensor.tolist = original
        torch.cuda.set_sync_debug_mode(0)
    assert waits == []
