import itertools
import random

import numpy as np
import pytest
import torch

from flashtree.errors import FlashtreeError
from flashtree.tree import (
    TreeSpec,
    accept_walk,
    ancestor_mask,
    ancestor_table,
    build_chain,
    build_tree,
    build_tree_reference,
    chain_spec,
)
from flashtree.tree.mix import root_only
from flashtree.tree.walk import _next_node


def brute_force(logits: torch.Tensor) -> tuple[list[tuple[int, ...]], dict]:
    """All prefixes of [D, V] logits in tie order, by enumeration, and each one's (depth, level rank)."""
    lp = torch.log_softmax(logits.float(), -1).numpy()
    D, V = lp.shape
    order = [sorted(range(V), key=lambda v: (-lp[d, v], v)) for d in range(D)]
    tok_rank = [{v: i for i, v in enumerate(o)} for o in order]
    level = {(): (np.float32(0.0), 0)}
    ranked, where = [], {}
    for d in range(D):
        cands = [
            (prefix + (v,), np.float32(s + lp[d, v]), rank, tok_rank[d][v])
            for prefix, (s, rank) in level.items()
            for v in range(V)
        ]
        cands.sort(key=lambda c: (-c[1], c[2], c[3]))
        level = {c[0]: (c[1], i) for i, c in enumerate(cands)}
        for i, (prefix, s, _, _) in enumerate(cands):
            where[prefix] = (d + 1, i)
            if s > -np.inf:
                ranked.append((-float(s), d + 1, i, prefix))
    ranked.sort()
    return [r[-1] for r in ranked], where


def prefixes(spec: TreeSpec, r: int) -> list[tuple[int, ...]]:
    """Row r's real nodes as token tuples (root excluded), in output order."""
    tokens, parents = spec.tokens[r].tolist(), spec.parents[r].tolist()
    out = {0: ()}
    for i in range(1, int(spec.sizes[r])):
        out[i] = out[parents[i]] + (tokens[i],)
    return [out[i] for i in range(1, int(spec.sizes[r]))]


def check_structure(spec: TreeSpec, budgets: list[int]) -> None:
    """Prefix-closed, within budget, topological, consistent depths, distinct siblings, padding at the end."""
    R, N = spec.tokens.shape
    assert N == 1 + max(budgets)
    assert spec.parents[:, 0].eq(-1).all() and spec.depths[:, 0].eq(0).all()
    for r in range(R):
        n = int(spec.sizes[r])
        assert 1 <= n <= 1 + budgets[r]
        tok, par, dep = (t[r].tolist() for t in (spec.tokens, spec.parents, spec.depths))
        seen = set()
        for i in range(1, n):
            assert 0 <= par[i] < i and tok[i] >= 0
            assert dep[i] == dep[par[i]] + 1 and dep[i] >= dep[i - 1]
            assert (par[i], tok[i]) not in seen
            seen.add((par[i], tok[i]))
        assert tok[n:] == [-1] * (N - n) and par[n:] == [0] * (N - n) and dep[n:] == [1] * (N - n)
        assert max(dep[:n]) <= spec.depth_bound


@pytest.mark.parametrize("V,D", list(itertools.product([3, 4, 5, 6], [1, 2, 3, 4])))
def test_build_tree_is_exact_top_b(V, D):
    """build_tree returns exactly the top-b prefixes of brute-force enumeration, for a batch of rows with
    different budgets (1 .. past the number of prefixes), in (depth, level rank) order; the heap
    reference pops the same prefixes in the same tie order."""
    total = sum(V**d for d in range(1, D + 1))
    for seed in range(3):
        g = torch.Generator().manual_seed(1000 * V + 10 * D + seed)
        R = 6
        logits = torch.randn(R, D, V, generator=g) * 2
        budgets = [1, total, total + 3] + torch.randint(1, total + 1, (R - 3,), generator=g).tolist()
        spec = build_tree(torch.arange(R), logits, torch.tensor(budgets))
        check_structure(spec, budgets)
        assert spec.tokens[:, 0].tolist() == list(range(R))
        for r in range(R):
            ranked, where = brute_force(logits[r])
            want = ranked[: budgets[r]]
            got = prefixes(spec, r)
            assert set(got) == set(want)
            assert got == sorted(want, key=where.__getitem__)
            assert build_tree_reference(r, logits[r], budgets[r]) == want


def test_build_tree_every_budget():
    """One row repeated with every budget from 1 to past the number of prefixes: each row is exact, and
    each tree contains the previous one with its nodes in the same relative order."""
    V, D = 3, 3
    logits = torch.randn(1, D, V, generator=torch.Generator().manual_seed(7)).expand(42, D, V)
    budgets = list(range(1, 43))
    spec = build_tree(torch.zeros(42, dtype=torch.long), logits, torch.tensor(budgets))
    check_structure(spec, budgets)
    ranked, _ = brute_force(logits[0])
    for r, b in enumerate(budgets):
        assert set(prefixes(spec, r)) == set(ranked[:b])
        if r:
            assert prefixes(spec, r - 1) == [p for p in prefixes(spec, r) if p in set(prefixes(spec, r - 1))]


def test_int_budget_matches_tensor_budget():
    """An int budget gives the same tree as the same budget as a tensor, and records a static depth bound."""
    logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(3))
    a = build_tree(torch.tensor([1, 2, 3]), logits, 9)
    b = build_tree(torch.tensor([1, 2, 3]), logits, torch.tensor([9, 9, 9]))
    for x, y in zip((a.tokens, a.parents, a.depths, a.sizes), (b.tokens, b.parents, b.depths, b.sizes)):
        assert torch.equal(x, y)
    # The bound is static (D) on accelerators; on the CPU the builder stops at the first depth that
    # cannot place a node, so the bound may be smaller, but it always covers the real depths.
    assert int(a.depths.max()) <= a.max_depth <= 5 and not a.is_chain


@pytest.mark.parametrize("kind", ["integer", "uniform", "certain"])
def test_ties_are_deterministic(kind):
    """Exact ties (integer-valued or uniform logits, or a depth whose token has probability 1 so a child
    scores the same as its parent) give the same tree on every call, equal to the reference and to
    brute force in tie order, and still prefix-closed."""
    g = torch.Generator().manual_seed(11)
    V, D, R = 4, 4, 5
    if kind == "integer":
        logits = torch.randint(0, 3, (R, D, V), generator=g).float()
    elif kind == "uniform":
        logits = torch.zeros(R, D, V)
    else:
        logits = torch.randn(R, D, V, generator=g)
        logits[:, 1] = torch.tensor([0.0, 100.0, 0.0, 0.0])  # log-prob of token 1 is exactly 0
        logits[:, 3] = torch.tensor([0.0, 0.0, 0.0, 100.0])
        assert torch.log_softmax(logits[0, 1], -1)[1] == 0
    budgets = [1, 7, 20, 64, 400]
    specs = [build_tree(torch.zeros(R, dtype=torch.long), logits, torch.tensor(budgets)) for _ in range(3)]
    for s in specs[1:]:
        assert torch.equal(s.tokens, specs[0].tokens) and torch.equal(s.parents, specs[0].parents)
    check_structure(specs[0], budgets)
    for r, b in enumerate(budgets):
        ranked, where = brute_force(logits[r])
        assert build_tree_reference(0, logits[r], b) == ranked[:b]
        assert prefixes(specs[0], r) == sorted(ranked[:b], key=where.__getitem__)


def test_large_budget_and_padding():
    """Budget 1024 with D=16, V=5000 runs and is prefix-closed; a budget past the number of prefixes, or
    tokens of probability zero, leave the row padded instead of drafting impossible nodes."""
    logits = torch.randn(2, 16, 5000, generator=torch.Generator().manual_seed(5)) * 3
    spec = build_tree(torch.tensor([4, 2]), logits, torch.tensor([1024, 300]))
    check_structure(spec, [1024, 300])
    assert spec.sizes.tolist() == [1025, 301]
    lp = torch.log_softmax(logits, -1).numpy()
    for r in range(2):  # exact: no prefix just outside the tree outscores the worst one inside
        tok, par, dep = (t[r].tolist() for t in (spec.tokens, spec.parents, spec.depths))
        score = [np.float32(0.0)]
        for i in range(1, int(spec.sizes[r])):
            score.append(np.float32(score[par[i]] + lp[r, dep[i] - 1, tok[i]]))
        best_outside = -np.inf
        for i in range(int(spec.sizes[r])):
            if dep[i] < 16:
                taken = {tok[c] for c in range(1, len(tok)) if par[c] == i and c < int(spec.sizes[r])}
                free = np.delete(lp[r, dep[i]], list(taken))
                best_outside = max(best_outside, np.float32(score[i] + free.max()))
        assert best_outside <= min(score[1:])

    g = torch.Generator().manual_seed(6)
    small = torch.randn(2, 3, 2, generator=g)  # 2 + 4 + 8 = 14 prefixes
    spec = build_tree(torch.tensor([0, 1]), small, 20)
    check_structure(spec, [20, 20])
    assert spec.sizes.tolist() == [15, 15] and spec.num_nodes == 21
    every = itertools.chain.from_iterable(itertools.product(range(2), repeat=d) for d in (1, 2, 3))
    assert set(prefixes(spec, 0)) == set(every)

    masked = torch.randn(1, 3, 3, generator=g)
    masked[0, :, 2] = float("-inf")  # token 2 is impossible: 2 + 4 + 8 = 14 prefixes remain
    spec = build_tree(torch.tensor([0]), masked, 30)
    check_structure(spec, [30])
    assert spec.sizes.tolist() == [15] and 2 not in spec.tokens[0, 1:].tolist()
    assert set(prefixes(spec, 0)) == set(build_tree_reference(0, masked[0], 30))


def random_specs() -> list[TreeSpec]:
    """Built trees (with padded rows), hand-made random trees with no depth bound, and a chain."""
    g = torch.Generator().manual_seed(21)
    built = build_tree(torch.tensor([5, 6, 7]), torch.randn(3, 6, 4, generator=g), torch.tensor([30, 9, 1]))
    R, N = 4, 12
    rng = random.Random(21)
    parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, N)] for _ in range(R)])
    depths = torch.zeros(R, N, dtype=torch.long)
    for i in range(1, N):
        depths[:, i] = depths.gather(1, parents[:, i : i + 1].clamp(min=0))[:, 0] + 1
    # Siblings need distinct tokens: a child's token is its index among its siblings.
    tokens = torch.tensor([[3] + [int((p[1:i] == p[i]).sum()) for i in range(1, N)] for p in parents])
    handmade = TreeSpec(tokens, parents, depths, torch.full((R,), N))
    chain = chain_spec(torch.randint(0, 4, (3, 9), generator=g))
    return [built, handmade, chain]


def test_chain_and_ancestors():
    """build_chain is the argmax chain; the chain's mask is lower-triangular and its table matches the
    general path; ancestor_mask and ancestor_table of random trees match a loop over parents."""
    logits = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(13))
    chain = build_chain(torch.tensor([1, 2, 3]), logits)
    assert chain.is_chain and chain.num_nodes == 8 and chain.batch_size == 3
    assert torch.equal(chain.tokens[:, 1:], logits.argmax(-1)) and chain.tokens[:, 0].tolist() == [1, 2, 3]
    assert torch.equal(ancestor_mask(chain), torch.ones(3, 8, 8, dtype=torch.bool).tril().expand(3, 8, 8))
    general = TreeSpec(chain.tokens, chain.parents, chain.depths, chain.sizes)
    assert torch.equal(ancestor_table(chain), ancestor_table(general))
    assert torch.equal(ancestor_mask(chain), ancestor_mask(general))

    for spec in random_specs():
        table, mask = ancestor_table(spec), ancestor_mask(spec)
        R, N = spec.tokens.shape
        assert table.shape == (R, N, spec.depth_bound + 1) and mask.shape == (R, N, N)
        for r in range(R):
            for i in range(N):
                chain_up = [i]
                while spec.parents[r, chain_up[-1]] >= 0:
                    chain_up.append(int(spec.parents[r, chain_up[-1]]))
                want = [-1] * (spec.depth_bound + 1)
                for k, node in enumerate(reversed(chain_up)):
                    want[k] = node
                assert table[r, i].tolist() == want
                assert mask[r, i].nonzero()[:, 0].tolist() == sorted(chain_up)


def walk_oracle(spec: TreeSpec, picks: torch.Tensor, r: int) -> tuple[list[int], int]:
    """Row r's accepted node path and bonus, by a Python loop over children."""
    tok, par, pick = spec.tokens[r].tolist(), spec.parents[r].tolist(), picks[r].tolist()
    path = [0]
    while True:
        here = path[-1]
        kids = [c for c in range(len(tok)) if par[c] == here and tok[c] == pick[here] and tok[c] >= 0]
        if not kids:
            return path, pick[path[-1]]
        path.append(kids[0])


def test_accept_walk_matches_loop():
    """accept_walk equals a Python walk on random trees (padded rows, hand-made trees, chains) with random
    picks and with picks that follow the tree to a leaf: path, num_nodes, bonus and tokens."""
    g = torch.Generator().manual_seed(31)
    for spec in random_specs():
        R, N = spec.tokens.shape
        follow = torch.randint(0, 4, (R, N), generator=g)
        deepest = spec.depths.masked_fill(torch.arange(N) >= spec.sizes[:, None], -1).max(1)
        for r in range(R):  # picks that walk to the deepest node of each row
            node = int(deepest.indices[r])
            while node > 0:
                follow[r, spec.parents[r, node]] = spec.tokens[r, node]
                node = int(spec.parents[r, node])
        random_picks = (torch.randint(0, 4, (R, N), generator=g), torch.randint(0, 2, (R, N), generator=g))
        for picks in (*random_picks, follow, torch.full((R, N), -1)):  # -1 picks must not match padding
            res = accept_walk(spec, picks)
            width = spec.depth_bound + 1
            assert res.path.shape == res.tokens.shape == (R, width)
            for r in range(R):
                path, bonus = walk_oracle(spec, picks, r)
                n = len(path)
                assert int(res.num_nodes[r]) == n and int(res.tokens[r, n - 1]) == bonus
                assert res.path[r].tolist() == path + [-1] * (width - n)
                emitted = [int(spec.tokens[r, i]) for i in path[1:]] + [bonus]
                assert res.tokens[r].tolist() == emitted + [-1] * (width - n)
        assert torch.equal(accept_walk(spec, follow).num_nodes, deepest.values + 1)


def test_cpu_depth_pruning_stays_exact():
    """Diffuse deep positions make the CPU builder stop early; the tree still equals the heap oracle."""
    g = torch.Generator().manual_seed(11)
    for scale in (0.5, 2.0, 8.0):
        logits = torch.randn(2, 8, 50, generator=g) * scale
        for budget in (1, 5, 20, 60):
            spec = build_tree(torch.tensor([0, 0]), logits, budget)
            for r in range(2):
                n = int(spec.sizes[r])
                got = set()
                for i in range(1, n):
                    path, j = [], i
                    while j > 0:
                        path.append(int(spec.tokens[r, j]))
                        j = int(spec.parents[r, j])
                    got.add(tuple(reversed(path)))
                assert got == set(build_tree_reference(0, logits[r], budget))
                assert int(spec.depths[r, :n].max()) <= spec.max_depth


def old_next_node(spec: TreeSpec, picks: torch.Tensor) -> torch.Tensor:
    """The walk's child lookup before it became a scatter: an [R, N, N] match, kept as a reference."""
    R, N = spec.tokens.shape
    idx = torch.arange(N)
    match = (
        (spec.parents[:, None, :] == idx[:, None])
        & (spec.tokens[:, None, :] == picks[:, :, None])
        & (spec.tokens[:, None, :] >= 0)
    )
    return torch.where(match.any(-1), match.to(torch.uint8).argmax(-1), -1)


def random_tree_spec(rng: random.Random, R: int, N: int, bound: str) -> TreeSpec:
    """R random trees of up to N nodes over tokens 0..5 (distinct among siblings, <= 4 children),
    padded with the builder's convention; max_depth is None, exact, or loose."""
    tokens = torch.full((R, N), -1)
    parents = torch.zeros(R, N, dtype=torch.long)
    depths = torch.ones(R, N, dtype=torch.long)
    sizes = []
    for r in range(R):
        n = rng.randint(1, N)
        tokens[r, 0], parents[r, 0], depths[r, 0] = rng.randrange(6), -1, 0
        used: dict[int, list[int]] = {0: []}
        for i in range(1, n):
            p = rng.choice([q for q in used if len(used[q]) < 4])
            tok = rng.choice([t for t in range(6) if t not in used[p]])
            used[p].append(tok)
            used[i] = []
            tokens[r, i], parents[r, i], depths[r, i] = tok, p, depths[r, p] + 1
        sizes.append(n)
    deepest = int(depths.masked_fill(torch.arange(N) >= torch.tensor(sizes)[:, None], 0).max())
    max_depth = {"none": None, "exact": deepest, "loose": deepest + 2}[bound]
    return TreeSpec(tokens, parents, depths, torch.tensor(sizes), max_depth=max_depth)


def test_accept_walk_randomized_against_oracle_and_old_walk():
    """On hundreds of random batches (random trees with padding rows and any depth bound, built trees,
    chains) with random, -1 and tree-following picks, accept_walk equals the Python oracle walk, and
    its child lookup equals the old [R, N, N] match bit for bit."""
    rng = random.Random(41)
    g = torch.Generator().manual_seed(41)
    bounds = ["none", "exact", "loose"]
    specs = [random_tree_spec(rng, rng.randint(1, 5), rng.randint(1, 24), bounds[i % 3]) for i in range(150)]
    for trial in range(30):
        R = rng.randint(1, 4)
        budgets = torch.randint(1, 40, (R,), generator=g)
        specs.append(build_tree(torch.randint(0, 3, (R,), generator=g), torch.randn(R, 5, 3, generator=g) * 2, budgets))
        specs.append(chain_spec(torch.randint(0, 3, (R, rng.randint(1, 12)), generator=g)))
    for spec in specs:
        R, N = spec.tokens.shape
        follow = torch.randint(0, 6, (R, N), generator=g)
        for r in range(R):  # picks that follow the tree from the root to a random node
            node = rng.randrange(int(spec.sizes[r]))
            while node > 0:
                follow[r, spec.parents[r, node]] = spec.tokens[r, node]
                node = int(spec.parents[r, node])
        for picks in (torch.randint(0, 6, (R, N), generator=g), torch.full((R, N), -1), follow):
            general = TreeSpec(spec.tokens, spec.parents, spec.depths, spec.sizes)
            if not spec.is_chain:
                assert torch.equal(_next_node(spec, picks), old_next_node(spec, picks))
            else:  # the chain fast path agrees with the general lookup
                assert torch.equal(_next_node(spec, picks), old_next_node(general, picks))
            res = accept_walk(spec, picks)
            width = spec.depth_bound + 1
            for r in range(R):
                path, bonus = walk_oracle(spec, picks, r)
                n = len(path)
                assert int(res.num_nodes[r]) == n
                assert res.path[r].tolist() == path + [-1] * (width - n)
                emitted = [int(spec.tokens[r, i]) for i in path[1:]] + [bonus]
                assert res.tokens[r].tolist() == emitted + [-1] * (width - n)


def test_a_lone_root_walks_as_the_oracle():
    """An AR step's one-node spec takes the walk's shortcut: the root accepted, the pick at it
    emitted, with the oracle's path and tokens (a chain of one and a root-only tree)."""
    picks = torch.tensor([[5], [2], [-1]])
    for spec in (chain_spec(torch.tensor([[1], [4], [0]])), root_only(torch.tensor([1, 4, 0]), 1)):
        res = accept_walk(spec, picks)
        for r in range(3):
            path, bonus = walk_oracle(spec, picks, r)
            assert res.path[r].tolist() == path and res.tokens[r].tolist() == [bonus]
            assert int(res.num_nodes[r]) == 1


def test_max_budget_and_prune_keywords():
    """max_budget = the budget's max gives the same tree as no bound; a larger one only pads more; a
    smaller one caps rows' budgets. prune=True and prune=False give the same tree tensors (the
    pruned max_depth is a tighter bound that still covers every depth)."""
    g = torch.Generator().manual_seed(51)
    logits = torch.randn(4, 8, 30, generator=g) * 3
    logits[2, :, 0] = 12.0  # one deep row, so pruning has something to skip in the others
    roots = torch.tensor([0, 1, 2, 3])
    budgets = torch.tensor([5, 40, 17, 1])
    base = build_tree(roots, logits, budgets)
    fields = ("tokens", "parents", "depths", "sizes", "scores")
    same = build_tree(roots, logits, budgets, max_budget=40)
    assert all(torch.equal(getattr(same, f), getattr(base, f)) for f in fields)
    wide = build_tree(roots, logits, budgets, max_budget=50)
    assert wide.num_nodes == 51 and torch.equal(wide.sizes, base.sizes)
    for f in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(wide, f)[:, :41], getattr(base, f))
    assert wide.tokens[:, 41:].eq(-1).all() and wide.scores[:, 41:].eq(float("-inf")).all()
    capped = build_tree(roots, logits, budgets, max_budget=10)
    want = build_tree(roots, logits, budgets.clamp(max=10))
    assert all(torch.equal(getattr(capped, f), getattr(want, f)) for f in fields)
    for prune in (True, False):
        for b in (budgets, 23):
            got, ref = build_tree(roots, logits, b, prune=prune), build_tree(roots, logits, b, prune=not prune)
            assert all(torch.equal(getattr(got, f), getattr(ref, f)) for f in fields)
    pruned, full = build_tree(roots, logits, 23, prune=True), build_tree(roots, logits, 23, prune=False)
    assert full.max_depth == 8 and int(pruned.depths.max()) <= pruned.max_depth <= full.max_depth


def test_no_host_read_without_prune(monkeypatch):
    """With prune=False and max_budget, build_tree and accept_walk read nothing back to the host: every
    tensor-to-Python conversion and nonzero() is made to fail, and both still run."""
    g = torch.Generator().manual_seed(61)
    logits = torch.randn(3, 6, 500, generator=g)
    logits[0, :, 7] = 0.0  # a tie-prone row: the static tie pass runs on every row anyway
    budgets = torch.tensor([9, 30, 2])
    build_tree(torch.tensor([1, 2, 3]), logits, budgets, max_budget=30, prune=False)  # warm the pair cache

    def refuse(*_args, **_kw):
        raise AssertionError("host read")

    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    spec = build_tree(torch.tensor([1, 2, 3]), logits, budgets, max_budget=30, prune=False)
    accept_walk(spec, torch.randint(0, 500, spec.tokens.shape, generator=g))
    monkeypatch.undo()
    assert spec.sizes.tolist() == [10, 31, 3]


def test_bad_budget_is_a_clear_error():
    """A budget below one node, as an int or as max_budget, is a FlashtreeError, not a traceback."""
    logits = torch.randn(1, 3, 5)
    for kw in ({"budget": 0}, {"budget": torch.tensor([3]), "max_budget": 0}):
        with pytest.raises(FlashtreeError, match="at least 1"):
            build_tree(torch.tensor([0]), logits, **kw)


def test_depth_pruning_never_changes_the_tree():
    """Over many random batches (diffuse, peaked, bf16-tied, decaying confidence), the pruned CPU build
    equals the unpruned one tensor for tensor, and pruning does skip depths in most of them."""
    g = torch.Generator().manual_seed(71)
    skipped = 0
    for trial in range(60):
        R, D, V = 3, 10, 64
        logits = torch.randn(R, D, V, generator=g) * [0.5, 2.0, 4.0][trial % 3]
        logits[:, :, 0] += torch.linspace(float(trial % 7) * 2, 0, D)  # a favourite that fades with depth
        if trial % 4 == 0:
            logits = logits.bfloat16().float()
        budgets = torch.randint(1, V + 1, (R,), generator=g) // (1 + trial % 2)
        pruned = build_tree(torch.zeros(R, dtype=torch.long), logits, budgets, prune=True)
        full = build_tree(torch.zeros(R, dtype=torch.long), logits, budgets, prune=False)
        for f in ("tokens", "parents", "depths", "sizes", "scores"):
            assert torch.equal(getattr(pruned, f), getattr(full, f)), (trial, f)
        skipped += pruned.max_depth < full.max_depth
    assert skipped >= 30
