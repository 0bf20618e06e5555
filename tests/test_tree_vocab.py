"""The tree builder at real vocabulary sizes, with ties planted at and around the k-th token value.

The reference for the per-depth token top-k is `old_topk`, the rule build_tree used before it
dropped its [R, D, V] int64 keys, copied here verbatim.
"""
import pytest
import torch

import flashtree.tree.build as build
from flashtree.errors import FlashtreeError
from flashtree.tree import build_tree, build_tree_reference
from flashtree.tree.host import token_topk

VOCABS = {"qwen3": 151936, "llama3": 128256, "qwen3.5": 248320}


def old_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The old build._topk: an exact (value desc, index asc) key over the whole last dim."""
    bits = torch.copysign(x, -1.0).view(torch.int32).to(torch.int64)
    key = torch.add(torch.arange(x.shape[-1], device=x.device), bits, alpha=1 << 32)
    idx = key.topk(k, dim=-1, largest=False).indices
    return x.gather(-1, idx), idx


# As rows of a [4, 3, V] tree, the first pattern of each line sits at depth 1, where ties decide the most.
PATTERNS = ["far_past_margin", "smooth", "bf16",
            "past_margin", "end_at_margin", "fill_to_k",
            "uniform", "masked", "certain",
            "staircase", "bf16_flat", "smooth_wide"]
MARGIN_OVERFLOW = {"end_at_margin", "past_margin", "far_past_margin", "uniform", "masked", "certain"}


def planted(V: int, k: int, seed: int) -> torch.Tensor:
    """[12, V] logit rows, one per PATTERNS entry, built around the k-th value and the margin.

    fill_to_k .. far_past_margin: k//2 distinct top values, then one group of equal logits whose
    last member sits at position k-1, at the last candidate (k + MARGIN - 1), one past it, and far
    past it. Tie groups hold ids 0 and V-1 and random ids between, so the lowest ids are not first.
    """
    g = torch.Generator().manual_seed(seed)
    c = k + build.MARGIN
    above = k // 2

    def background() -> torch.Tensor:
        return torch.randn(V, generator=g) - 20

    def ids(n: int) -> torch.Tensor:
        inner = torch.randperm(V - 2, generator=g)[: max(n - 2, 0)] + 1
        return torch.cat([torch.tensor([V - 1, 0]), inner])[:n]

    def group(size: int) -> torch.Tensor:
        row = background()
        chosen = ids(above + size)
        row[chosen[:above]] = 0.01 * torch.arange(above, 0, -1).float()  # close above: ties reach the tree
        row[chosen[above:]] = 0.0
        return row

    rows = {
        "smooth": torch.randn(V, generator=g) * 3,
        "bf16": (torch.randn(V, generator=g) * 3).bfloat16().float(),
        "fill_to_k": group(k - above),
        "end_at_margin": group(c - above),
        "past_margin": group(c - above + 1),
        "far_past_margin": group(3 * c),
        "uniform": torch.zeros(V),
        "certain": torch.zeros(V).index_fill_(0, ids(1), 1e4),  # one token of probability 1
        "bf16_flat": torch.randn(V, generator=g).bfloat16().float(),
        "smooth_wide": torch.randn(V, generator=g) * 10,
    }
    masked = torch.full((V,), float("-inf"))
    masked[ids(max(1, k // 2))] = torch.randn(max(1, k // 2), generator=g)
    rows["masked"] = masked  # fewer than k tokens possible: the k-th value is -inf
    stair = background()
    steps = ids(7 * (c // 7 + 3))
    stair[steps] = 1.0 - 0.01 * torch.arange(steps.numel()).div(7, rounding_mode="floor").float()
    rows["staircase"] = stair  # groups of 7 equal values straddle both k and the margin
    return torch.stack([rows[p] for p in PATTERNS])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (floats compared as their int32 bits)."""
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("V", [*VOCABS.values(), 4096])
def test_token_topk_equals_old_rule(V):
    """_token_topk returns the old rule's values (same bits) and ids for every planted tie pattern, with
    and without host reads, for k from 1 to 256; V=4096 also covers the tie-count path (k=64, where
    the margin would leave the CPU topk's partial sort) and the nth-element regime (k=256). So does
    the numpy build's host.token_topk."""
    for k in (1, 16, 64, 256):
        lp = torch.log_softmax(planted(V, k, seed=V + k), -1).view(3, 4, V)
        want_lp, want_id = old_topk(lp, k)
        for host in (True, False):
            got_lp, got_id = build._token_topk(lp, k, host)
            assert same(got_lp, want_lp) and same(got_id, want_id), (V, k, host)
        np_lp, np_id = token_topk(lp.view(12, V).numpy(), k)  # the numpy build's
        assert same(torch.from_numpy(np_lp).view(3, 4, k), want_lp), (V, k)
        assert same(torch.from_numpy(np_id).view(3, 4, k), want_id), (V, k)


def test_margin_overflow_goes_to_the_full_row_pass(monkeypatch):
    """With host reads, exactly the rows whose candidates may miss a tie at the k-th value take the
    full-vocabulary pass: every pattern whose tie group reaches the margin, never a row whose ties
    all fit (fill_to_k) or that has none (smooth)."""
    V, k = VOCABS["qwen3"], 64
    lp = torch.log_softmax(planted(V, k, seed=1), -1)[None]
    seen = []

    def spy(rows_lp, *args):
        seen.append(rows_lp)
        return tie_fix(rows_lp, *args)

    tie_fix = build._tie_fix
    monkeypatch.setattr(build, "_tie_fix", spy)
    build._token_topk(lp, k, host=True)
    fixed = {PATTERNS[int(i)] for i in torch.cat([(lp[0] == r).all(1).nonzero()[:, 0] for r in seen[0]])}
    assert MARGIN_OVERFLOW <= fixed
    assert not {"smooth", "fill_to_k", "smooth_wide"} & fixed


def test_tie_fix_repairs_wrong_candidates():
    """_tie_fix turns candidates holding the wrong members of a tie group (the highest ids instead of
    the lowest) into the exact answer, and leaves the values above the k-th one as they were."""
    V, k = VOCABS["llama3"], 16
    lp = torch.log_softmax(planted(V, k, seed=2), -1)
    want_lp, want_id = old_topk(lp, k)
    t = want_lp[:, -1]
    # Wrong candidates: the values > t in order, then the highest ids equal to t.
    above = want_lp > t[:, None]
    worst_ties = torch.where(lp == t[:, None], torch.arange(V).float(), -1.0).topk(k, 1).indices
    g = above.sum(1, keepdim=True)
    j = torch.arange(k)
    wrong_id = torch.where(j < g, want_id, worst_ties.gather(1, (j - g).clamp(min=0)))
    got_lp, got_id = build._tie_fix(lp, lp.gather(1, wrong_id), wrong_id, t)
    assert same(got_lp, want_lp) and same(got_id, want_id)
    assert not torch.equal(wrong_id, want_id)  # the test is not vacuous


def old_rule_tree(monkeypatch, *args, **kw):
    """build_tree with its vocabulary top-k swapped back to the old rule."""
    with monkeypatch.context() as m:
        m.setattr(build, "_token_topk", lambda lp, k, host: old_topk(lp, k))
        return build_tree(*args, **kw)


def tree_tensors(spec):
    return spec.tokens, spec.parents, spec.depths, spec.sizes, spec.scores


@pytest.mark.parametrize("name", VOCABS)
def test_build_tree_at_real_vocab(name, monkeypatch):
    """At each real vocabulary size, with the planted tie patterns spread over depths, build_tree equals
    the old builder tensor for tensor (scores bit for bit), with and without pruning, and each row's
    nodes are exactly the heap oracle's top-budget prefixes."""
    V = VOCABS[name]
    logits = planted(V, 64, seed=3).view(4, 3, V)
    budgets = torch.tensor([64, 64, 64, 40])
    roots = torch.tensor([1, 2, 3, 4])
    want = old_rule_tree(monkeypatch, roots, logits, budgets)
    for prune in (None, True, False):
        got = build_tree(roots, logits, budgets, prune=prune)
        assert all(same(a, b) for a, b in zip(tree_tensors(got), tree_tensors(want))), prune
    for r in range(4):
        n = int(want.sizes[r])
        nodes = {0: ()}
        for i in range(1, n):
            nodes[i] = nodes[int(want.parents[r, i])] + (int(want.tokens[r, i]),)
        assert set(nodes.values()) - {()} == set(build_tree_reference(0, logits[r], int(budgets[r])))


def test_bf16_logits_at_real_vocab(monkeypatch):
    """bfloat16 draft logits (as a bf16 LM head gives: many exact ties) build the same tree as the old
    builder, at depth 15 and budgets 16 and 64."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 15, VOCABS["qwen3"], generator=g) * 2).bfloat16()
    logits[:, :, 0] = 14.0  # a clear favourite per depth, so the tree goes deep
    for budget in (16, 64):
        want = old_rule_tree(monkeypatch, torch.tensor([0, 1]), logits, budget)
        got = build_tree(torch.tensor([0, 1]), logits, budget)
        assert int(want.depths.max()) > 3
        assert all(same(a, b) for a, b in zip(tree_tensors(got), tree_tensors(want)))


def test_vocabulary_too_large():
    """A vocabulary past 2^24 tokens (where float32 can no longer key token ids) is a clear error."""
    with pytest.raises(FlashtreeError, match="too large"):
        build_tree(torch.zeros(1, dtype=torch.long), torch.empty(1, 1, (1 << 24) + 1, device="meta"), 4)
