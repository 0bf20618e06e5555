"""The Markov tree builder returns exactly the top-B prefixes of a conditional draft, in the
documented tie order, and reduces to build_tree / build_chain on a draft without pairwise terms."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from flashtree.tree import build_chain, build_tree
from flashtree.tree.markov import build_markov_chain, build_markov_tree
from test_tree import check_structure, prefixes


def brute_force(cand: list[list[int]], trans: np.ndarray) -> list[tuple[tuple[int, ...], float, int, int]]:
    """Every prefix by enumeration, in the global tie order: (tokens, score, depth, level rank).

    Level d is sorted by (score desc, parent's level rank, candidate index); scores are float32
    sums added root to leaf; depth 1 (and a parent-free draft, P = 1) reads row 0.
    """
    D, P, K = trans.shape
    level = [((), np.float32(0.0), 0)]  # (candidate-index path, score, level rank)
    out = []
    for d in range(D):
        kids = []
        for path, s, rank in level:
            row = path[-1] if (d > 0 and P > 1) else 0
            kids += [(path + (c,), np.float32(s + trans[d, row, c]), rank, c) for c in range(K)]
        kids.sort(key=lambda x: (-x[1], x[2], x[3]))
        level = [(p, s, i) for i, (p, s, _, _) in enumerate(kids)]
        out += [(tuple(cand[j][c] for j, c in enumerate(p)), float(s), d + 1, i) for p, s, i in level if s > -np.inf]
    out.sort(key=lambda x: (-x[1], x[2], x[3]))
    return out


def random_draft(R, D, K, V, P, seed, ties=False, zeros=False):
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(D)]) for _ in range(R)])
    trans = torch.log_softmax(torch.randn(R, D, P, K, generator=g), -1) - torch.rand(R, D, P, 1, generator=g)
    if ties:  # few exact values: equal scores across parents, siblings and depths
        trans = -torch.randint(1, 4, (R, D, P, K), generator=g).float() / 2
    if zeros:  # probability-zero candidates are never drafted
        trans = trans.masked_fill(torch.rand(R, D, P, K, generator=g) < 0.25, float("-inf"))
    return cand, trans


@pytest.mark.parametrize("K,D", list(itertools.product([1, 2, 3, 4], [1, 2, 3, 4])))
@pytest.mark.parametrize("kind", ["markov", "ties", "zeros", "marginal"])
def test_markov_tree_is_exact_top_b(K, D, kind):
    """For a batch with budgets from 1 to past the number of prefixes, the tree holds exactly the
    brute-force top-b (same order by (depth, level rank), same float32 scores)."""
    R, V = 5, 9
    P = 1 if kind == "marginal" else K
    total = sum(K**d for d in range(1, D + 1))
    for seed in range(3):
        cand, trans = random_draft(R, D, K, V, P, seed=100 * K + 10 * D + seed, ties=kind == "ties",
                                   zeros=kind == "zeros")
        budgets = [1 + (r * 7 + seed * 3) % (total + 2) for r in range(R)]
        roots = torch.arange(R) + 50
        spec = build_markov_tree(roots, cand, trans, torch.tensor(budgets))
        check_structure(spec, budgets)
        for r in range(R):
            ref = brute_force(cand[r].tolist(), trans[r].numpy())[: budgets[r]]
            ref.sort(key=lambda x: (x[2], x[3]))  # the output's order: by depth, then level rank
            assert prefixes(spec, r) == [x[0] for x in ref], (seed, r)
            n = int(spec.sizes[r])
            assert spec.scores[r, 1:n].tolist() == [x[1] for x in ref]
            assert spec.tokens[r, 0] == 50 + r


def test_a_weak_parent_can_have_a_strong_child():
    """DESIGN.md's stronger claim fails under a Markov draft: here the true level-2 top-2 holds a
    child whose parent ranks 3rd at depth 1; the builder still returns the exact top-B tree."""
    cand = torch.tensor([[[10, 11, 12], [20, 21, 22]]])
    lp = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    strong, weak = torch.log(torch.tensor([0.98, 0.01, 0.01])), torch.log(torch.tensor([0.34, 0.33, 0.33]))
    trans = torch.stack([torch.stack([lp, lp, lp]), torch.stack([weak, weak, strong])])[None]
    level2 = sorted(((cand[0, 0, p].item(), cand[0, 1, c].item()), float(lp[p] + trans[0, 1, p, c]))
                    for p in range(3) for c in range(3))
    best2 = sorted(level2, key=lambda x: -x[1])[:2]
    assert (12, 20) in [x[0] for x in best2]  # its parent 12 is 3rd of depth 1: not in a top-2 level
    for b in (2, 3, 4, 6):
        spec = build_markov_tree(torch.tensor([1]), cand, trans, b)
        ref = brute_force(cand[0].tolist(), trans[0].numpy())[:b]
        assert sorted(prefixes(spec, 0)) == sorted(x[0] for x in ref)


@pytest.mark.parametrize("B,K", [(1, 1), (4, 4), (5, 8), (16, 16), (16, 40), (64, 64)])
def test_no_pairwise_terms_give_build_trees_tree(B, K):
    """A DFlash-1 draft (conditionals = the marginals on the top-K candidates, whatever the parent)
    gives build_tree's tree, tensor for tensor, when K >= B; and the greedy chain is build_chain's."""
    R, D, V = 4, 6, 80
    g = torch.Generator().manual_seed(B * 100 + K)
    logits = torch.randn(R, D, V, generator=g) * 2
    logits[1] = torch.randint(0, 4, (D, V), generator=g).float()  # many exact ties
    lp = torch.log_softmax(logits, -1)
    order = torch.stack([torch.stack([torch.tensor(sorted(range(V), key=lambda v: (-lp[r, d, v].item(), v))[:K])
                                      for d in range(D)]) for r in range(R)])
    cand_lp = lp.gather(2, order)
    roots = torch.tensor([3, 1, 4, 1])
    budgets = torch.tensor([B, max(1, B // 2), B, 1])
    want = build_tree(roots, logits, budgets)
    for trans in (cand_lp[:, :, None, :], cand_lp[:, :, None, :].expand(R, D, K, K)):
        got = build_markov_tree(roots, order, trans, budgets, max_budget=B)
        for name in ("tokens", "parents", "depths", "sizes", "scores"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.max_depth >= int(got.depths.max())  # a bound; pruning may lower either builder's
        chain = build_markov_chain(roots, order, trans)
        assert torch.equal(chain.tokens, build_chain(roots, logits).tokens)


def test_markov_chain_is_the_greedy_path():
    """The chain follows argmax_c q(c | previous pick) at every depth, ties to the lower index."""
    R, D, K, V = 6, 5, 4, 12
    cand, trans = random_draft(R, D, K, V, K, seed=7, ties=True)
    spec = build_markov_chain(torch.zeros(R, dtype=torch.long), cand, trans)
    assert spec.is_chain and spec.tokens.shape == (R, D + 1)
    for r in range(R):
        prev, path = 0, []
        for d in range(D):
            row = trans[r, d, prev if d > 0 else 0].tolist()
            prev = max(range(K), key=lambda c: (row[c], -c))
            path.append(int(cand[r, d, prev]))
        assert spec.tokens[r, 1:].tolist() == path


def test_tree_scores_feed_the_budget_logic():
    """Scores are the drafter log-probs of each node's prefix, so expected accepts stay meaningful:
    a node's score is its parent's plus its own conditional log-prob."""
    cand, trans = random_draft(3, 4, 5, 20, 5, seed=3)
    spec = build_markov_tree(torch.zeros(3, dtype=torch.long), cand, trans, 12)
    for r in range(3):
        for i in range(1, int(spec.sizes[r])):
            p, d = int(spec.parents[r, i]), int(spec.depths[r, i])
            c = cand[r, d - 1].tolist().index(int(spec.tokens[r, i]))
            row = 0 if d == 1 else cand[r, d - 2].tolist().index(int(spec.tokens[r, p]))
            assert spec.scores[r, i] == torch.tensor(float(spec.scores[r, p])) + trans[r, d - 1, row, c]


def test_pruning_never_changes_the_tree():
    """With prune=False (no host reads, all depths built) the tree is the pruned build's."""
    for seed in range(4):
        cand, trans = random_draft(4, 8, 6, 30, 6, seed=seed)
        trans[:, 3:] -= 6.0  # deep levels far below the budget's floor: the CPU build stops early
        budgets = torch.tensor([3, 16, 40, 1])
        a = build_markov_tree(torch.zeros(4, dtype=torch.long), cand, trans, budgets, max_budget=40)
        b = build_markov_tree(torch.zeros(4, dtype=torch.long), cand, trans, budgets, max_budget=40, prune=False)
        for name in ("tokens", "parents", "depths", "sizes", "scores"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
