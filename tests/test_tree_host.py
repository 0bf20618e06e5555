"""The numpy build (flashtree/tree/host.py) against the tensor build it stands in for on the CPU.

Both follow build.py's tie rule; these tests hold them to the same TreeSpec bit for bit on inputs
made to hit the rule's corners: logits quantised to a few values (equal log-probs everywhere, at
the k-th token value included), -inf log-probs, certain tokens (log-prob +0.0), bf16 rounding,
per-row budgets, max_budget, non-contiguous logits, and vocabularies on both sides of the size
where the numpy top-k starts to skip most of the row.
"""
import dataclasses

import numpy as np
import pytest
import torch

import flashtree.tree.build as build
from flashtree.tree import TreeSpec, build_tree
from flashtree.tree import host
from flashtree.tree.host import token_topk


def identical(a: TreeSpec, b: TreeSpec) -> str | None:
    """The first field where a and b differ (floats by their bits, tensors by dtype and shape too), or None."""
    for f in dataclasses.fields(TreeSpec):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if not isinstance(x, torch.Tensor):
            if x != y:
                return f.name
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            return f.name
        if x.dtype == torch.float32:
            x, y = x.view(torch.int32), y.view(torch.int32)
        if not torch.equal(x, y):
            return f.name
    return None


def tie_prone_logits(g: torch.Generator, trial: int, R: int, D: int, V: int) -> torch.Tensor:
    """[R, D, V] logits for one trial: few distinct values, noise, -inf entries and certain tokens by turns."""
    levels = int(torch.randint(1, 6, (), generator=g))
    logits = torch.randint(0, levels, (R, D, V), generator=g).float() * float(torch.rand((), generator=g) * 4)
    if trial % 2:
        logits += torch.randn(R, D, V, generator=g) * (trial % 5)
    if trial % 4 == 0:
        logits[torch.rand(R, D, V, generator=g) < 0.4] = float("-inf")
        logits[:, :, 0] = 0.0  # no all -inf row (log_softmax would give NaN)
    if trial % 6 == 1:
        logits[:, :, V // 2] = 1e4  # a certain token: log-prob +0.0, every other one -inf or below
    if trial % 7 == 3:
        logits = logits.bfloat16().float()
    if trial % 9 == 5:  # the same values, laid out with depth as the innermost stride
        logits = logits.transpose(1, 2).contiguous().transpose(1, 2)
    return logits


def test_host_build_equals_tensor_build():
    """Over many tie-prone random batches, build_tree on CPU logits (the numpy build) gives the tensor
    build's TreeSpec bit for bit: tokens, parents, depths, sizes, scores, ranks, first, max_depth.
    Many trials tie at each depth's k-th token value, where the choice among equal log-probs decides."""
    g = torch.Generator().manual_seed(81)
    tied_at_k = 0
    for trial in range(600):
        R = int(torch.randint(1, 6, (), generator=g))
        D = int(torch.randint(1, 7, (), generator=g))
        V = int(torch.randint(1, 40, (), generator=g)) if trial % 3 else int(torch.randint(40, 3000, (), generator=g))
        b = int(torch.randint(1, 70, (), generator=g))
        budget = b if trial % 3 == 0 else torch.randint(1, b + 1, (R,), generator=g)
        max_budget = None if trial % 5 else b + int(torch.randint(0, 5, (), generator=g))
        logits = tie_prone_logits(g, trial, R, D, V)
        roots = torch.randint(0, 9, (R,), generator=g)

        got = build_tree(roots, logits, budget, max_budget=max_budget)
        width = build._width(budget, max_budget)
        want = build.build_tree_tensor(roots, logits, budget, width, prune=True)
        assert identical(got, want) is None, (trial, identical(got, want))
        k = min(width, V)
        if k < V:
            lp = torch.log_softmax(logits, -1).sort(-1, descending=True).values
            tied_at_k += bool((lp[..., k - 1] == lp[..., k]).any())
    assert tied_at_k >= 100


@pytest.mark.parametrize("V", [600, 4096, 151936])
def test_token_topk_on_quantised_rows(V):
    """host.token_topk equals an exact (value desc, id asc) sort, values bit for bit, on rows of few
    distinct values (tie groups far larger than k), smooth rows, and rows mostly -inf."""
    g = torch.Generator().manual_seed(V)
    rows = [
        torch.randint(0, 3, (V,), generator=g).float(),
        torch.randint(0, 50, (V,), generator=g).float() * 0.1,
        torch.randn(V, generator=g) * 3,
        torch.where(torch.rand(V, generator=g) < 0.99, float("-inf"), torch.randn(V, generator=g)),
        (torch.randn(V, generator=g) * 2).bfloat16().float(),
    ]
    lp = torch.log_softmax(torch.stack(rows), -1).numpy()
    for k in (1, 8, 64, 300):
        order = np.lexsort((np.broadcast_to(np.arange(V), lp.shape), -lp), axis=1)[:, :k]
        vals, ids = token_topk(lp, k)
        assert np.array_equal(ids, order), (V, k)
        assert np.array_equal(vals.view(np.int32), np.take_along_axis(lp, order, 1).view(np.int32)), (V, k)


def test_cpu_builds_take_the_numpy_path_unless_prune_is_off(monkeypatch):
    """CPU logits go to the numpy build by default and with prune=True; prune=False keeps the tensor
    build, whose shapes depend only on the inputs' (a compiled caller's contract)."""
    calls = []
    host_build = build.build_tree_host
    monkeypatch.setattr(build, "build_tree_host", lambda *a: calls.append(1) or host_build(*a))
    logits = torch.randn(2, 4, 50)
    for prune, used in ((None, 1), (True, 1), (False, 0)):
        calls.clear()
        build_tree(torch.tensor([1, 2]), logits, 6, prune=prune)
        assert len(calls) == used, prune


def test_one_row_best_first_build_equals_tensor_build():
    """A single row with an int budget (the vLLM plugin's and a batch-1 engine's case) is built best first
    from a heap (host.best_first_one); over tie-prone logits it gives the tensor build's TreeSpec bit for
    bit, -0.0 and +0.0 scores of certain tokens included, and it is the path taken in most trials
    (the rest have fewer finite nodes than the budget and take the level build)."""
    g = torch.Generator().manual_seed(7)
    taken = 0
    real = host.best_first_one
    def counting(*args):
        nonlocal taken
        spec = real(*args)
        taken += spec is not None
        return spec
    host.best_first_one = counting
    try:
        for trial in range(800):
            D = int(torch.randint(1, 9, (), generator=g))
            V = int(torch.randint(1, 40, (), generator=g)) if trial % 3 else int(torch.randint(40, 3000, (), generator=g))
            b = int(torch.randint(1, 70, (), generator=g))
            logits = tie_prone_logits(g, trial, 1, D, V)
            roots = torch.randint(0, 9, (1,), generator=g)
            got = build_tree(roots, logits, b)
            want = build.build_tree_tensor(roots, logits, b, b, prune=True)
            assert identical(got, want) is None, (trial, identical(got, want))
    finally:
        host.best_first_one = real
    assert taken >= 400
