"""budget="auto": the speculation policy. It never changes output, drafts only for the requests it
speculates for, goes to AR when drafts stop paying (and probes its way back), sizes trees from
the cost model, and caches that model on disk. Also the exactness of the trees it builds: cut,
per-row and depth-trimmed builds equal smaller builds, and mixed windows hold their parts."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from flashtree import LLM, EngineConfig, LLMEngine, SamplingParams
from flashtree.engine import cost_model
from flashtree.engine.cost_model import CostModel, Grid
from flashtree.engine.policy import AR, CHAIN, TREE, Policy, RoundPlan
from flashtree.engine.runner import AR_TIMED_EVERY
from flashtree.engine.selector import AR_ARM, COLD_ROUNDS, TIMED, Selector
from flashtree.engine.sequence import Request
from flashtree.tree import build_chain, build_tree
from flashtree.tree.budget import expected_accepts, truncate
from flashtree.tree.mix import cat_rows, pad_spec, place_rows, root_only
from flashtree.tree.value import node_kinds, node_reach, spine_mask, value_curve
from tiny import make_drafter, make_target

FIELDS = ("tokens", "parents", "depths", "sizes", "scores")


def _same(a, b, rows=None) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        x = x.expand_as(a.tokens) if x.dim() == 2 else x
        y = y.expand_as(b.tokens) if y.dim() == 2 else y
        if rows is not None:
            x = x[rows]
        assert torch.equal(x, y), f


# ---- exact trees ------------------------------------------------------------------------

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
            _same(truncate(big, b), build_tree(torch.tensor([1, 2, 3]), logits, b))


def test_partial_trees_equal_smaller_builds():
    """A per-row budget tensor under a static max builds each row's own smaller tree (padded), and
    scoring only the first b depths (the policy trims the drafter's LM head) changes nothing:
    a b-node tree is at most b deep."""
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        D, V = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(2, 12, (1,), generator=g))
        logits = torch.randn(4, D, V, generator=g) * 3
        if trial % 3 == 0:
            logits = logits.round()
        roots = torch.tensor([5, 6, 7, 8])
        budgets = torch.randint(1, 20, (4,), generator=g)
        mixed = build_tree(roots, logits, budgets, max_budget=20)
        for r in range(4):
            b = int(budgets[r])
            alone = pad_spec(build_tree(roots[r : r + 1], logits[r : r + 1], b), 21)
            for f in ("tokens", "parents", "depths", "scores"):
                assert torch.equal(getattr(mixed, f)[r], getattr(alone, f)[0]), (trial, r, f)
            assert int(mixed.sizes[r]) == int(alone.sizes[0])
        for b in range(1, D + 1):
            _same(build_tree(roots, logits[:, :b], b), build_tree(roots, logits, b))


def test_mixed_window_holds_its_parts():
    """Tree rows, chain rows and lone roots placed into one window keep every node of their own
    builds, and the lone roots are plain AR rows (one node, the rest padding)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 6, 9, generator=g) * 2
    roots = torch.arange(10, 15)
    rows = torch.tensor([3, 0, 4])  # batch rows: two trees, then one chain
    tree = build_tree(roots[rows[:2]], logits[:2], 7)
    chain = build_chain(roots[rows[2:]], logits[2:3, :4])
    lp = torch.log_softmax(logits[2:3, :4], -1).amax(-1).cumsum(1)
    chain.scores = torch.cat([torch.zeros(1, 1), lp], 1)
    part = cat_rows([pad_spec(tree, 8), pad_spec(chain, 8)])
    window = place_rows(root_only(roots, 8), rows, part)
    _same(window, pad_spec(tree, 8), rows=rows[:2])
    assert torch.equal(window.tokens[4, :5], chain.tokens[0])
    assert torch.equal(window.parents[4, :5], torch.arange(-1, 4))
    for r in (1, 2):
        assert window.tokens[r, 0] == roots[r] and (window.tokens[r, 1:] == -1).all() and window.sizes[r] == 1


def test_node_values_and_curves():
    """The value curve of the nodes' reach is the drafter's own expected acceptance per budget, and
    the spine is exactly the nodes whose every token is its depth's top-1."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 7, generator=g) * 2
    spec = build_tree(torch.tensor([0, 1, 2]), logits, 24)
    assert torch.allclose(value_curve(spec, node_reach(spec)), expected_accepts(spec), atol=1e-5)
    top = logits.argmax(-1)
    for r in range(3):
        for i in range(1, int(spec.sizes[r])):
            path, n = [], i
            while n > 0:
                path.append(n)
                n = int(spec.parents[r, n])
            on = all(int(spec.tokens[r, m]) == int(top[r, int(spec.depths[r, m]) - 1]) for m in path)
            assert bool(spine_mask(spec)[r, i]) == on
    assert torch.equal(node_kinds(spec) == 0, spine_mask(spec))


def test_observed_acceptance_is_the_walks_expectation():
    """The calibration's observation: with argmax picks, each node's reach (picks matching down
    its path) counted by depth and kind is exactly what the walk accepts; with sampled picks, the
    product of the target's probabilities down the path is the walk's mean (Monte Carlo)."""
    from flashtree.tree import accept_walk
    from flashtree.tree.value import depth_mass, path_reach, walked_mass

    g = torch.Generator().manual_seed(4)
    V, D = 5, 4
    spec = build_tree(torch.tensor([0, 1]), torch.randn(2, D, V, generator=g) * 2, 12)
    kinds = node_kinds(spec)
    parent, token = spec.parents.clamp(min=0), spec.tokens.clamp(min=0)
    real = (spec.tokens >= 0) & (torch.arange(spec.num_nodes) > 0)
    for trial in range(20):
        picks = torch.randint(0, V, spec.tokens.shape, generator=g)
        picks[:, 0] = torch.where(torch.rand(2, generator=g) < 0.7, spec.tokens[:, 1], picks[:, 0])
        edge = torch.where(picks.gather(1, parent) == spec.tokens, 0.0, float("-inf"))
        reach = torch.where(real, path_reach(spec, edge).exp(), 0.0)
        walk = accept_walk(spec, picks)
        assert torch.equal(depth_mass(spec, kinds, reach, D), walked_mass(spec, kinds, walk.path, D))
    probs = torch.softmax(torch.randn(2, spec.num_nodes, V, generator=g), -1)
    edge = probs.log().flatten(1).gather(1, parent * V + token)
    reach = torch.where(real, path_reach(spec, edge).exp(), 0.0)
    expected = depth_mass(spec, kinds, reach, D)
    total = torch.zeros_like(expected)
    n = 4000
    for _ in range(n):
        picks = torch.multinomial(probs.view(-1, V), 1, generator=g).view(2, -1)
        total += walked_mass(spec, kinds, accept_walk(spec, picks).path, D)
    assert torch.allclose(total / n, expected, atol=0.03)


# ---- the policy on synthetic costs --------------------------------------------------------

def _cost(per_node: float, fixed: float = 0.010, draft: float = 0.004, rows: int = 16) -> CostModel:
    windows = [1, 2, 3, 5, 9, 17, 33, 65]
    rs = [1, rows]
    verify = Grid(rs, windows, [[fixed + per_node * r * n for n in windows] for r in rs])
    return CostModel(verify, Grid(rs, [0, 15], [[draft * r, draft * r * 1.2] for r in rs]),
                     Grid([1, rows], [4, 64], [[1e-4, 2e-4], [1e-4 * rows, 2e-4 * rows]]),
                     Grid(rs, [0, 1], [[0, 0], [0, 0]]), {"rows": rows, "window": 65, "budget": 64})


def _requests(n: int, temperature: float = 0.0) -> list[Request]:
    reqs = [Request([1, 2], SamplingParams(temperature=temperature)) for _ in range(n)]
    for i, r in enumerate(reqs):
        r.slot = i
    return reqs


def _feed(policy: Policy, plan: RoundPlan, reqs: list[Request], accept: float, confidence: float = 0.8,
          geometric: bool = False, slow: float = 1.0, room: list[int] | None = None) -> None:
    """Pretend the round ran, with a drafter whose spine reach is confidence^depth and whose trees
    are chains, and a target that accepts each spine node with probability `accept`; drafting
    rounds take `slow` times the cost model's seconds."""
    D, k = max(plan.depth, 1), plan.drafting
    cols = policy.curve_columns(plan)
    raw = confidence ** np.arange(1, D + 1)
    extras = np.zeros((k, 2 * cols + 5 * D))
    extras[:, :cols] = np.minimum(policy.grid[:cols], D)  # spine nodes in the top-b tree
    extras[:, 2 * cols : 2 * cols + D] = raw
    extras[:, 2 * cols + D : 2 * cols + 3 * D : 2] = raw  # predicted, spine kind
    extras[:, 2 * cols + 3 * D :: 2] = raw * accept  # observed, spine kind
    measured = None
    if plan.measure:  # the selector's: accepted tokens per tree size, the spine's run, not cut short (by_size)
        m = plan.measure
        if geometric:  # depth d accepted with probability accept^d: bigger trees add less
            curve = np.cumsum(accept ** np.arange(1, D + 1))
            row = (curve[np.minimum(policy.grid[:m], D) - 1].tolist(), float(curve[-1]), False)
        else:
            row = ((accept * np.minimum(policy.grid[:m], D)).tolist(), accept * D, False)
        measured = [row] * k
    if plan.arm is not None and not plan.learn:
        extras = None
    accepted = [int(round(accept * min(D, 15))) if m != AR else 0 for m in plan.modes]
    policy.observe(plan, [r.slot for r in reqs], extras if k else None, accepted, room, measured)
    policy.timed(plan, len(reqs), plan.seconds * (slow if k else 1.0))


def test_split_follows_cost_and_batch():
    """The per-request split (mixed batches). Cheap verify nodes buy big windows; expensive ones small windows or AR; and the same
    acceptance that pays for trees at batch 1 buys a smaller window at batch 16."""
    reqs = _requests(1)
    cheap = Policy(_cost(1e-5), 16, 16, 64, 4096).split(reqs)
    steep = Policy(_cost(2e-2), 16, 16, 64, 4096).split(reqs)
    assert cheap.window > 8 and cheap.drafting == 1
    assert steep.window <= 2 or steep.drafting == 0
    one = Policy(_cost(2e-4), 16, 16, 64, 4096)
    many = Policy(_cost(2e-4), 16, 16, 64, 4096)
    w1 = np.median([one.split(reqs).window for _ in range(20)])
    w16 = np.median([many.split(_requests(16)).window for _ in range(20)])
    assert w16 < w1


def test_split_collapse_goes_to_ar_and_probes_back():
    """The per-request split: when nothing drafted is ever accepted the policy stops drafting, yet it keeps probing now and
    then (a small share of rounds), and once drafts are accepted again it speculates again."""
    policy = Policy(_cost(2e-4), 16, 16, 64, 4096)
    reqs = _requests(1, temperature=1.0)
    modes = []
    for _ in range(400):
        plan = policy.split(reqs)
        modes.append(plan.modes[0])
        _feed(policy, plan, reqs, accept=0.0)
    late = modes[100:]
    assert late.count(AR) / len(late) > 0.9
    assert any(m != AR for m in late)  # still probing
    for _ in range(300):  # the drafter turns right: the next probes see it
        plan = policy.split(reqs)
        modes.append(plan.modes[0])
        _feed(policy, plan, reqs, accept=1.0)
    assert modes[-50:].count(AR) < 10


def test_split_right_drafter_speculates_at_once():
    """The per-request split, with a drafter the target always agrees with: the policy drafts from the first rounds on, with big
    windows, and never settles on AR (the failure on the demo pair was the opposite: a policy that
    under-forecast a good drafter and stayed on AR)."""
    policy = Policy(_cost(2e-4), 16, 16, 64, 4096)
    reqs = _requests(1)
    modes, windows = [], []
    for _ in range(60):
        plan = policy.split(reqs)
        modes.append(plan.modes[0])
        windows.append(plan.window)
        _feed(policy, plan, reqs, accept=1.0)
    assert AR not in modes[:1] and modes[2:].count(AR) == 0
    assert np.median(windows[2:]) > 8


def test_split_finds_a_streak_after_a_cold_stretch():
    """The per-request split. Greedy acceptance comes in streaks (text falls into a copy). After a long cold stretch on AR
    steps, a request whose class has won big before is re-tested every few rounds, so a streak
    that starts is found within a few rounds, not dozens, and then kept."""
    policy = Policy(_cost(2e-4), 16, 16, 64, 4096)
    first = _requests(1)
    for _ in range(30):  # an earlier request of the class: drafts paid big
        plan = policy.split(first)
        _feed(policy, plan, first, accept=1.0)
    reqs = _requests(1)
    reqs[0].slot = 0
    for _ in range(60):  # this one goes cold, and its drafts are unsure: the policy moves to AR steps
        plan = policy.split(reqs)
        _feed(policy, plan, reqs, accept=0.0, confidence=0.3)
    for n in range(40):  # the streak starts
        plan = policy.split(reqs)
        _feed(policy, plan, reqs, accept=1.0)
        if plan.modes[0] != AR:
            break
    assert n < 12, f"the streak was found only after {n} rounds"
    following = []
    for _ in range(10):
        plan = policy.split(reqs)
        following.append(plan.modes[0])
        _feed(policy, plan, reqs, accept=1.0)
    assert following.count(AR) <= 1


def _run(policy: Policy, reqs: list[Request], rounds: int, accept: float, geometric: bool = False) -> list[RoundPlan]:
    plans = []
    for _ in range(rounds):
        plan = policy.plan(reqs)
        plans.append(plan)
        _feed(policy, plan, reqs, accept=accept, geometric=geometric)
    return plans


def test_selector_follows_cost_and_batch():
    """Requests that sample alike get the selector's measured arm: cheap verify nodes buy big trees,
    steep ones AR steps (once a few probes have shown it), and the acceptance that pays for a big tree at
    batch 1 buys a smaller one at batch 16. Every row of a round does the same, but for probes."""
    cheap = _run(Policy(_cost(1e-5), 16, 16, 64, 4096), _requests(1), 40, 0.8)
    steep = _run(Policy(_cost(2e-2), 16, 16, 64, 4096), _requests(1), 100, 0.2)  # drafting: 2/3 of AR's rate
    assert all(p.arm is not None for p in cheap + steep)
    assert np.median([p.window for p in cheap[10:]]) >= 16  # the chain (window 16) or a bigger tree
    assert sum(p.drafting for p in steep[50:]) <= 0.15 * 50  # a few probes, once the evidence is in
    one = _run(Policy(_cost(2e-3), 16, 16, 64, 4096), _requests(1), 40, 0.9, geometric=True)
    w1 = np.median([p.window for p in one[10:]])
    many = _run(Policy(_cost(2e-3), 16, 16, 64, 4096), _requests(16), 40, 0.9, geometric=True)
    # Every row alike, except probes from AR steps: those draft a quarter of the rows.
    assert all(len(set(p.modes)) == 1 or p.drafting == 4 for p in many)
    assert np.median([p.window for p in many[10:]]) < w1


def test_ar_steps_are_timed_while_drafting_leads():
    """Drafting rounds run 1.5x the cost model, AR steps at it. Never timed, AR steps would be
    priced at the drafting arms' error (1.5x too); only their own rounds correct that, and
    while drafting leads none would be played. So a few are, to time them (TIMED of them,
    between the opening's drafting rounds), and from then on AR steps are priced at their own
    seconds."""
    policy = Policy(_cost(1e-5), 16, 16, 64, 4096)
    reqs = _requests(16)
    plans = []
    for _ in range(40):
        plans.append(policy.plan(reqs))
        _feed(policy, plans[-1], reqs, accept=1.0, slow=1.5)
    timing = [i for i, p in enumerate(plans) if not p.drafting]
    assert len(timing) == TIMED and all(plans[i].timed for i in timing)
    assert timing[0] <= COLD_ROUNDS + 1 and timing[-1] - timing[0] < 2 * TIMED
    assert all(p.drafting == 16 for p in plans[timing[-1] + 1:])  # drafting still leads
    modelled = policy._arm_table(16)[0]
    priced = policy.times.seconds(16, modelled)
    assert priced[AR_ARM] == pytest.approx(modelled[AR_ARM], rel=0.01)
    assert priced[plans[-1].arm] == pytest.approx(1.5 * modelled[plans[-1].arm], rel=0.01)
    # A batch size where AR steps were never timed takes their error from the nearest size.
    modelled = policy._arm_table(8)[0]
    assert policy.times.seconds(8, modelled)[AR_ARM] == pytest.approx(modelled[AR_ARM], rel=0.01)
    assert policy.times.counts(8, modelled)[AR_ARM] == TIMED
    # Under a frozen cost model (tensor parallelism) nothing is timed, so nothing is played for it.
    frozen = Policy(_cost(1e-5), 16, 16, 64, 4096)
    frozen.cost.frozen = True
    reqs = _requests(16)
    for _ in range(12):
        plan = frozen.plan(reqs)
        assert plan.drafting == 16
        _feed(frozen, plan, reqs, accept=1.0, slow=1.5)


def test_the_selector_counts_the_tokens_requests_keep_not_the_walk():
    """Requests with 3 tokens of room keep at most 2 drafted tokens a round, however far the walk
    went (the rest lies past max_tokens): every arm's estimate is what is kept. The level (the
    walk's base) is not cut, so it still says how well the text is drafted."""
    estimates = {}
    for room in (None, 3):
        policy = Policy(_cost(1e-5), 16, 16, 64, 4096)
        reqs = _requests(4)
        for _ in range(60):
            plan = policy.plan(reqs)
            _feed(policy, plan, reqs, accept=0.8, room=None if room is None else [room] * 4)
        estimates[room] = policy.selector.accepted(0)
    (free, free_chain), (cut, cut_chain) = estimates[None], estimates[3]
    seen = [j for j in range(len(policy.grid)) if policy.selector.stats[0].seen[j] > 0]
    assert max(free[j] for j in seen) > 5 and max(cut[j] for j in seen) <= 2.0 + 1e-6
    assert free_chain > 5 and cut_chain <= 2.0 + 1e-6
    sel = Selector(policy.grid, 15)
    for _ in range(200):  # (the chain leans on the tree of its size, unseen here, for its first rows)
        sel.observe(0, 4, None, [12] * 4, kept=[2] * 4)
    assert sel.stats[0].level == pytest.approx(3.0) and sel.accepted(0)[1] == pytest.approx(2.0, rel=0.05)


def test_ar_steps_priced_by_a_few_slow_rounds_are_timed_again_while_drafting_leads():
    """AR steps are timed as drafting leads (TIMED of them), and those happen to run 1.5x the
    cost model. Then acceptance falls (0.8 to 0.45 a node) until AR steps and the best drafting
    arm are about even at AR's true price, while at the stale one drafting leads by half. AR
    steps near the best arm are re-timed now and then (a runner-up whose price may be stale), so
    AR steps are played in most rounds: a price set by a few slow early rounds does not stand
    for good. (Never re-timed, the chain took 94% of the last 200 rounds. The exploration share
    settles while the best arm holds, so the re-timing comes some 300 rounds after the fall.)"""
    policy = Policy(_cost(1e-4), 16, 16, 64, 4096)
    reqs = _requests(16)
    timed, ar_rounds = policy.timed, []

    def slow_first_ar(plan, rows, seconds, held=(0.0, 0)):
        if not plan.drafting:
            ar_rounds.append(plan)
            seconds *= 1.5 if len(ar_rounds) <= TIMED else 1.0
        timed(plan, rows, seconds, held)

    policy.timed = slow_first_ar
    plans = []
    for i in range(800):
        plans.append(policy.plan(reqs))
        _feed(policy, plans[-1], reqs, accept=0.8 if i < 100 else 0.45)
    assert sum(p.drafting == 16 for p in plans[:100]) > 90 and len(ar_rounds) >= TIMED
    assert sum(p.drafting for p in plans[-200:]) < 0.1 * 200 * 16
    modelled = policy._arm_table(16)[0]
    assert policy.times.seconds(16, modelled)[AR_ARM] == pytest.approx(modelled[AR_ARM], rel=0.05)


def test_the_openings_ar_steps_are_timed_between_its_drafting_rounds():
    """The machine runs at half speed for the first two rounds, then at full (a shared box's other
    job ends). The opening times AR steps between its drafting rounds, not after them, so both
    arms have one slow round of three and their prices keep the cost model's ratio; timed after
    them, AR steps would be priced at half a drafting round's ratio and played where drafting
    leads."""
    policy = Policy(_cost(1e-4, draft=2e-4), 16, 16, 64, 4096)
    reqs = _requests(16)
    timed, count = policy.timed, []

    def busy_at_first(plan, rows, seconds, held=(0.0, 0)):
        count.append(plan)
        timed(plan, rows, seconds * (2.0 if len(count) <= 2 else 1.0), held)

    policy.timed = busy_at_first
    plans = []
    for _ in range(60):
        plans.append(policy.plan(reqs))
        _feed(policy, plans[-1], reqs, accept=0.6)
    assert [bool(p.drafting) for p in plans[:2 * TIMED]] == [True, False] * TIMED
    modelled = policy._arm_table(16)[0]
    priced = policy.times.seconds(16, modelled)
    drafted = plans[0].arm
    ratio = (priced[AR_ARM] / priced[drafted]) / (modelled[AR_ARM] / modelled[drafted])
    assert ratio == pytest.approx(1.0, rel=0.05)
    assert sum(p.drafting == 16 for p in plans[-30:]) > 25


def test_a_drafting_price_from_slow_rounds_is_timed_again_from_ar_steps():
    """Drafting rounds run 2x the cost model for the first 40 rounds (cold caches, a busy
    machine), then at it; AR steps always at it. At the slow price AR steps win and are played.
    A probe from AR steps drafts a few rows, which measures acceptance but not the price, so
    until THIN of its rounds are timed at this batch size a probe drafts every row: the price
    comes down and drafting, the better arm at its true price, is played again."""
    policy = Policy(_cost(1e-4, draft=2e-4), 16, 16, 64, 4096)
    reqs = _requests(16)
    timed, count = policy.timed, []

    def slow_early_drafts(plan, rows, seconds, held=(0.0, 0)):
        count.append(plan)
        timed(plan, rows, seconds * (2.0 if plan.drafting and len(count) <= 40 else 1.0), held)

    policy.timed = slow_early_drafts
    plans = []
    for _ in range(1500):
        plans.append(policy.plan(reqs))
        _feed(policy, plans[-1], reqs, accept=0.5)
    assert sum(not p.drafting for p in plans[10:40]) > 25  # AR steps, at the slow price
    assert sum(p.drafting == 16 for p in plans[-200:]) > 0.8 * 200
    modelled = policy._arm_table(16)[0]
    arm = plans[-1].arm
    assert policy.times.seconds(16, modelled)[arm] / modelled[arm] < 1.2 * policy.times.load


def test_held_back_context_is_priced_to_ar_steps_not_to_the_next_drafting_round():
    """A drafting round that also appended 40 held-back tokens (0.2 s of its 0.3 s) is timed as
    its own 0.1 s: the append is what the AR steps that parked those tokens cost, so AR's price
    carries it per row that parks (5 ms a token here), and a plain row parks nothing."""
    policy = Policy(_cost(1e-3), 16, 16, 64, 4096)
    drafting = policy.plan(_requests(4))  # a new class opens with a tree
    assert drafting.arm >= 0 and drafting.drafting == 4
    policy.timed(drafting, 4, 0.3, (0.2, 40))
    assert policy.held_cost == pytest.approx(0.005)
    assert policy.times.load == pytest.approx(0.1 / drafting.seconds)  # the first timed round sets it
    priced = policy.ar_price({AR_ARM: 0.01, 3: 0.05}, 3)
    assert priced == {AR_ARM: pytest.approx(0.025), 3: 0.05}
    assert policy.ar_price({AR_ARM: 0.01}, 0) == {AR_ARM: 0.01}


def test_selector_collapse_goes_to_ar_and_still_probes():
    """When nothing drafted is accepted the selector goes to AR steps within a few rounds, and from
    then on its probes cost a small share of the time, smaller the more drafting loses (here a
    one-node tree costs 1.4x an AR step: a few percent of rounds; at 3x, well under 1%), yet
    never stop."""
    for per_node, share in ((2e-4, 0.05), (2e-2, 0.01)):
        plans = _run(Policy(_cost(per_node), 16, 16, 64, 4096), _requests(1, temperature=1.0), 3000, accept=0.0)
        late = [p.drafting for p in plans[20:]]
        assert 0 < sum(late) < share * len(late)


def test_mixed_batches_are_split_per_request():
    """A batch whose requests sample differently is planned per request (the split), and the
    split may treat its rows differently."""
    policy = Policy(_cost(2e-4), 16, 16, 64, 4096)
    reqs = _requests(2)
    reqs[1].params = SamplingParams(temperature=1.0)
    plan = policy.plan(reqs)
    assert plan.arm is None


# ---- the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    target = make_target(root / "t", vocab=16, logit_scale=3.0)
    return target, make_drafter(root / "d", target_layers=4, vocab=16, block_size=8)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_auto_is_lossless(pair, batch):
    """Greedy output under the policy equals AR's at several batch sizes (whatever it chose)."""
    target, drafter = pair
    prompts = [[1, 2, 3], [4, 5], list(range(1, 13)), [7], [8, 9, 10], [2, 2], [3, 1, 4, 1, 5], [6, 6, 6], [9]]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = LLM(str(target), None, method="ar", device="cpu", max_model_len=128).generate(prompts, params)
    llm = LLM(str(target), str(drafter), device="cpu", max_model_len=128, max_batch=batch, max_budget=32)
    assert llm.engine.runner.policy is not None  # auto is the default
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    stats = out[0].stats
    assert len(stats.modes) == len(stats.draft_sizes) == len(stats.predicted_accepts) == stats.rounds
    assert set(stats.modes) <= {"ar", "chain", "tree"}
    assert llm.engine.runner.cache.lengths.count(0) < batch + 1


def test_auto_on_hybrid_target(tmp_path):
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
    out = LLM(str(target), str(drafter), budget="auto", max_budget=32, device="cpu",
              max_model_len=96).generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_ar_when_acceptance_collapses(tmp_path, monkeypatch):
    """A drafter that is wrong by construction (random weights over a vocabulary where the target
    is near-deterministic): output still equals AR, the policy ends up on AR steps, and the
    drafter only ever runs on the rows that speculate (its calls are counted with their rows).
    The cost model is a fixed synthetic one, so the decisions do not depend on this machine's timing."""
    target = make_target(tmp_path / "t", vocab=64, logit_scale=6.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=64, block_size=8, seed=7)
    prompts = [[i, i + 1, i + 2] for i in range(1, 9)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    ref = LLM(str(target), None, method="ar", device="cpu", max_model_len=128).generate(prompts, params)
    llm = LLM(str(target), str(drafter), device="cpu", max_model_len=128, max_batch=4, max_budget=32)
    runner = llm.engine.runner
    runner.policy.cost = _cost(2e-4, rows=4)
    monkeypatch.setattr(CostModel, "refine", lambda *a, **k: None)
    monkeypatch.setattr(Policy, "timed", lambda *a, **k: None)  # prices stay the synthetic model's
    calls: list[int] = []
    forward = runner.drafter.forward
    runner.drafter.forward = lambda noise, ctx: (calls.append(noise.shape[0]), forward(noise, ctx))[1]
    rounds: list[tuple[int, int, int]] = []  # (rows, speculating rows, drafter rows) per round
    timing: list[bool] = []  # per round: AR steps played to time them (always learned from)
    step = runner.step

    def counted(reqs):
        before = len(calls)
        out = step(reqs)
        rounds.append((len(reqs), runner.last_plan.drafting, sum(calls[before:])))
        timing.append(runner.last_plan.timed)
        return out

    runner.step = counted
    learned: list[int] = []  # the policy rounds (their count as of each one) that were learned from
    learn = runner.learn
    runner.learn = lambda plan, *a: (learned.append(runner.policy.rounds), learn(plan, *a))[1]
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert all(drafter_rows == drafting for _, drafting, drafter_rows in rounds)
    # Every drafting round is learned from; of plain AR rounds, a sample and those played to time them.
    assert len(learned) == len(set(learned))
    plain = [i + 1 for i, (_, d, _) in enumerate(rounds) if not d]
    assert {i for i, (_, d, _) in enumerate(rounds, 1) if d} <= set(learned)
    assert set(learned) & set(plain) == {i for i in plain if i % AR_TIMED_EVERY == 0 or timing[i - 1]}
    late = rounds[len(rounds) // 3 :]
    assert sum(d for _, d, _ in late) <= 0.1 * sum(r for r, _, _ in late)
    modes = [m for o in out for m in o.stats.modes]
    assert modes.count("ar") / len(modes) > 0.8


def test_a_few_speculative_rows_among_plain_ones_are_priced_as_drafting_alone():
    """Rows that may draft (scouts) among plain rows: the round still verifies the window for
    every row, so drafting pays only if those rows' tokens pay for it. With a drafter the target
    always agrees with, drafting the whole batch of 16 beats AR steps (the chain, 1.4x on this
    cost model); two drafting rows in it do not (at best 0.6x): the batch takes AR steps,
    probing only now and then.
    Priced as if every row drafted, it drafted in every round."""
    policy = Policy(_cost(2e-4), 16, 16, 64, 4096)
    reqs = _requests(16)
    for _ in range(40):  # every row may draft: drafting wins
        plan = policy.plan(reqs)
        _feed(policy, plan, reqs, accept=1.0)
    assert plan.drafting == 16
    for r in reqs[2:]:
        r.speculative = False
    drafted = []
    for _ in range(200):
        plan = policy.plan(reqs)
        assert set(plan.draft_rows) <= {0, 1}
        drafted.append(plan.drafting > 0)
        _feed(policy, plan, reqs, accept=1.0)
    assert sum(drafted[20:]) < 0.1 * 180


def test_a_burst_is_admitted_at_the_batch_it_joins(tmp_path, monkeypatch):
    """Requests seated together are judged (Policy.admit) at the size of the batch they form, not
    at the last round's: after a lone request, a burst of three joins it as a batch of four."""
    target = make_target(tmp_path / "t", vocab=32)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=32, block_size=4)
    engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64,
                                    max_batch=4, max_budget=8))
    seen: list[int] = []
    admit = engine.runner.policy.admit
    monkeypatch.setattr(engine.runner.policy, "admit", lambda params, rows: (seen.append(rows), admit(params, rows))[1])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request([1, 2, 3], params)
    engine.step()
    for p in ([4, 5], [6, 7], [8, 9]):
        engine.add_request(p, params)
    while engine.has_unfinished:
        engine.step()
    assert seen == [1, 4, 4, 4]


def test_settled_class_seats_requests_the_drafter_never_sees(tmp_path, monkeypatch):
    """Once a class is settled on AR steps (a drafter wrong by construction, a synthetic cost
    model where drafting loses), new requests are seated plain: the drafter gets none of their
    prompt or tokens and no round drafts them, their rows in the held-back ring stay empty, one
    in SCOUT_EVERY still may draft, and every output equals AR's."""
    from flashtree.engine.policy import SCOUT_EVERY

    target = make_target(tmp_path / "t", vocab=64, logit_scale=6.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=64, block_size=8, seed=7)
    prompts = [[i, i + 1, i + 2] for i in range(1, 25)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = LLM(str(target), None, method="ar", device="cpu", max_model_len=96).generate(prompts, params)
    engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=96,
                                    max_batch=2, max_budget=32))
    runner = engine.runner
    runner.policy.cost = _cost(2e-3, rows=2)
    monkeypatch.setattr(CostModel, "refine", lambda *a, **k: None)
    monkeypatch.setattr(Policy, "timed", lambda *a, **k: None)
    plain_slots: set[int] = set()
    context_slots: list[int] = []
    add_context = runner.drafter.add_context
    runner.drafter.add_context = lambda ctx, f: (context_slots.extend(ctx.slots.tolist()), add_context(ctx, f))[1]
    drafted: list[Request] = []
    step = runner.step

    def counted(batch):
        out = step(batch)
        drafted.extend(batch[i] for i in runner.last_plan.draft_rows)
        return out

    runner.step = counted
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished:
        before = len(context_slots)
        engine.step()
        plain_slots = {r.slot for r in reqs if not r.speculative and not r.finished and r.num_computed}
        assert not plain_slots & set(context_slots[before:])
        assert all(runner.draft_cache.lengths[s] == 0 and runner.deferred.counts[s] == 0 for s in plain_slots)
    assert all(r.speculative for r in drafted)
    assert [r.output_ids for r in reqs] == [o.token_ids for o in ref]
    plain = [r for r in reqs if not r.speculative]
    assert len(plain) >= len(prompts) // 2  # most, once the class has settled
    assert all(set(r.stats.modes) == {"ar"} for r in plain)
    late = reqs[len(reqs) - SCOUT_EVERY * 2:]
    assert 1 <= sum(r.speculative for r in late) <= 3  # the scouts


def test_scouts_are_fewer_the_further_ar_steps_lead(monkeypatch):
    """Requests seated while their class is settled on AR steps: all draft below parity, one in
    SCOUT_EVERY where AR steps lead by SETTLED_LEAD, one in SCOUT_EVERY x lead^2 where they lead
    by more (drafting must gain that much to pay), and never fewer than one in SCOUT_MAX."""
    from flashtree.engine.policy import SCOUT_EVERY, SCOUT_MAX

    policy = Policy(_cost(2e-4), 16, 16, 64, 4096)
    params = SamplingParams(temperature=1.0)
    for lead, every in ((0.9, 1), (1.0, SCOUT_EVERY), (2.0, 4 * SCOUT_EVERY), (50.0, SCOUT_MAX)):
        monkeypatch.setattr(policy.selector, "lead", lambda *a, v=lead: v)
        policy.scouting.clear()
        seated = [policy.admit(params, 4) for _ in range(4 * every)]
        assert sum(seated) == 4, lead
        assert seated[every - 1] and not any(seated[: every - 1]), lead


def test_scouts_are_fewer_in_proportion_in_batches_past_scout_rows(monkeypatch):
    """A batch bigger than SCOUT_ROWS seats scouts in proportion fewer (about as many per round
    as a batch of SCOUT_ROWS holds): a round parks every row's features if one row is a scout."""
    from flashtree.engine.policy import SCOUT_EVERY, SCOUT_ROWS

    policy = Policy(_cost(2e-4), 16, 16, 64, 4096)
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(policy.selector, "lead", lambda *a: 1.0)
    for rows in (1, SCOUT_ROWS, 2 * SCOUT_ROWS, 16):
        every = SCOUT_EVERY * max(1, rows // SCOUT_ROWS)
        policy.scouting.clear()
        seated = [policy.admit(params, rows) for _ in range(3 * every)]
        assert sum(seated) == 3, rows
        assert seated[every - 1] and not any(seated[: every - 1]), rows


def test_a_seat_prices_ar_steps_without_the_drafter_context_they_would_park(monkeypatch):
    """A request seated plain parks no drafter context, so Policy.admit weighs AR steps at
    their bare price; the rounds' AR price (ar_price) carries the parking, for speculative rows."""
    policy = Policy(_cost(2e-4), 16, 16, 64, 4096)
    policy.held_cost = 1.0  # seconds per parked token: far dearer than any round
    seen = []
    monkeypatch.setattr(policy.selector, "lead", lambda cls, rows, seconds, ar: seen.append(ar) or 0.5)
    policy.admit(SamplingParams(temperature=1.0), 4)
    modelled, _ = policy._arm_table(4)
    assert seen == [pytest.approx(policy.times.seconds(4, modelled)[AR_ARM])]
    assert seen[0] < policy.ar_price(policy.times.seconds(4, modelled), 4)[AR_ARM] - 3.0


def test_plain_and_speculative_requests_share_prefixes_only_where_the_drafter_has_them(tmp_path, monkeypatch):
    """A plain request seated on a speculative one's prompt reuses its target rows and takes no
    drafter rows; a speculative request on a plain one's prompt reuses nothing (the drafter never
    saw it) and prefills it whole. Outputs equal AR's, and the speculative one's drafter cache
    equals a fresh prefill of its text."""
    target = make_target(tmp_path / "t", vocab=32, logit_scale=3.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=32, block_size=6)
    cfg = dict(target=str(target), device="cpu", dtype="float64", max_model_len=96, max_batch=1)
    engine = LLMEngine(EngineConfig(drafter=str(drafter), max_budget=8, **cfg))
    runner = engine.runner
    wanted = iter([True, False, True])
    monkeypatch.setattr(runner.policy, "admit", lambda params, rows: next(wanted))
    prompt = list(range(1, 12))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ar = LLMEngine(EngineConfig(drafter=None, method="ar", **cfg))
    ref = ar.add_request(prompt, params)
    while ar.has_unfinished:
        ar.step()
    done, drafter_rows = [], []
    for _ in range(3):
        req = engine.add_request(prompt, params)
        while engine.has_unfinished:
            engine.step()
        done.append(req)
        drafter_rows.append(runner.draft_cache.lengths[req.slot] + runner.deferred.counts[req.slot])
    first, plain, again = done
    assert [r.speculative for r in done] == [True, False, True]
    assert plain.stats.cached_tokens == len(prompt) - 1
    assert again.stats.cached_tokens == 0 and drafter_rows[1] == 0
    assert all(r.output_ids == ref.output_ids for r in done)
    text = prompt + again.output_ids[:-1]
    n = runner.draft_cache.lengths[again.slot] + runner.deferred.counts[again.slot]
    assert n == len(text) == runner.cache.lengths[again.slot]
    fresh = LLMEngine(EngineConfig(drafter=str(drafter), budget=4, **cfg))
    fresh.runner.seat(0, None, 0)
    fresh.runner.prefill(Request(text, SamplingParams(), slot=0), len(text))
    m = runner.draft_cache.lengths[again.slot]
    for layer in range(runner.draft_cache.k.shape[0]):
        assert torch.allclose(runner.draft_cache.k[layer, again.slot, :m], fresh.runner.draft_cache.k[layer, 0, :m],
                              atol=1e-9)


def test_deferred_context_equals_full_prefill(tmp_path):
    """A request alternating AR steps (its drafter context held back) and drafts ends with the same
    drafter cache as a single prefill of its whole text would give (float64)."""
    from flashtree.engine.policy import fixed_plan

    target = make_target(tmp_path / "t", vocab=32, logit_scale=3.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=32, block_size=6)
    engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", dtype="float64",
                                    max_model_len=160, max_batch=2, max_budget=8))
    runner = engine.runner
    turn = iter(range(10_000))

    def plan(reqs):
        runner.policy.plan(reqs)  # keep the policy's own bookkeeping going
        k = next(turn)
        p = fixed_plan(len(reqs), "ddtree", 6, 5) if k % 7 in (3, 6) else fixed_plan(len(reqs), "ar", 6, 5)
        if k % 7 == 5:  # one row drafts, the other does not
            p = fixed_plan(len(reqs), "ddtree", 6, 5)
            p.modes[0], p.draft_rows, p.tree_rows = AR, list(range(1, len(reqs))), len(reqs) - 1
        return p

    runner.plan = plan
    reqs = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=90, ignore_eos=True)),
            engine.add_request([4, 5], SamplingParams(max_tokens=90, ignore_eos=True))]
    held_back = 0
    while engine.has_unfinished:
        engine.step()
        held_back = max(held_back, *runner.deferred.counts)
        if all(len(r.output_ids) >= 60 for r in reqs):
            break
    assert held_back >= 3  # the drafter context did lag and catch up
    for req in reqs:
        ids = req.prompt_ids + req.output_ids[:-1]
        held = runner.deferred.counts[req.slot]
        if held:
            runner.append_held(runner.deferred.groups([req.slot]), runner.staging.upload(
                {f"held{held}": [req.slot], f"held{held}_starts": [runner.draft_cache.lengths[req.slot]]}))
        n = runner.draft_cache.lengths[req.slot]
        assert n == runner.cache.lengths[req.slot] == len(ids)
        fresh = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", dtype="float64",
                                       max_model_len=160, max_batch=1, budget=4))
        fresh.runner.seat(0, None, 0)
        fresh.runner.prefill(Request(ids, SamplingParams(), slot=0), len(ids))
        for layer in range(runner.draft_cache.k.shape[0]):
            assert torch.allclose(runner.draft_cache.k[layer, req.slot, :n], fresh.runner.draft_cache.k[layer, 0, :n],
                                  atol=1e-9)


def test_ar_rounds_under_auto_do_no_drafter_work(tmp_path):
    """An auto engine whose plans are all AR does what an `ar` engine does plus one feature write
    a round: no drafter forward, no drafter context beyond the prompts' (the held-back tokens
    append only when the ring fills), and a request seated on a finished one's prefix appends
    none of that one's held-back tokens. When that request then drafts, its output equals AR's
    and its drafter cache equals a full prefill of its text (float64)."""
    from flashtree.engine.draft_context import CAPACITY
    from flashtree.engine.policy import fixed_plan

    target = make_target(tmp_path / "t", vocab=32, logit_scale=3.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=32, block_size=6)
    cfg = dict(target=str(target), device="cpu", dtype="float64", max_model_len=200, max_batch=2)
    engine = LLMEngine(EngineConfig(drafter=str(drafter), max_budget=8, **cfg))
    runner = engine.runner
    drafting = {"on": False}

    def plan(reqs):
        runner.policy.plan(reqs)  # the policy's own bookkeeping, its choice overridden
        return fixed_plan(len(reqs), "ddtree" if drafting["on"] else "ar", 6, 5)

    runner.plan = plan
    forwards, context_rows = [], []
    forward, add_context = runner.drafter.forward, runner.drafter.add_context
    runner.drafter.forward = lambda noise, ctx: (forwards.append(noise.shape[0]), forward(noise, ctx))[1]
    runner.drafter.add_context = lambda ctx, f: (context_rows.append(f.shape[0] * f.shape[1]), add_context(ctx, f))[1]
    params = SamplingParams(max_tokens=CAPACITY + 20, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    first = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished:
        engine.step()
    assert forwards == []
    # The prompts, and one full ring per request (its tokens past the prompt's last).
    assert sum(context_rows) == sum(map(len, prompts)) + 2 * CAPACITY
    assert all(runner.deferred.counts[r.slot] == params.max_tokens - 1 - CAPACITY for r in first)

    # A new request on the first one's prompt: seated on its prefix with no drafter work (the
    # first one's held-back tokens lie past it), then drafting.
    base = first[0]
    ids = base.prompt_ids + base.output_ids[:70] + [9]
    drafting["on"] = True
    seat, seat_rows = runner.seat, []

    def counted_seat(*a, **k):
        n = len(context_rows)
        reused = seat(*a, **k)
        seat_rows.append(context_rows[n:])
        return reused

    runner.seat = counted_seat
    req = engine.add_request(ids, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert req.stats.cached_tokens == len(base.prompt_ids) and seat_rows == [[]]
    while engine.has_unfinished:
        engine.step()
    ar = LLMEngine(EngineConfig(drafter=None, method="ar", **cfg))
    ref = ar.add_request(ids, SamplingParams(max_tokens=20, ignore_eos=True))
    while ar.has_unfinished:
        ar.step()
    assert req.output_ids == ref.output_ids
    text = ids + req.output_ids[:-1]
    n = runner.draft_cache.lengths[req.slot]
    assert n == runner.cache.lengths[req.slot] == len(text) and runner.deferred.counts[req.slot] == 0
    fresh = LLMEngine(EngineConfig(drafter=str(drafter), budget=4, **{**cfg, "max_batch": 1}))
    fresh.runner.seat(0, None, 0)
    fresh.runner.prefill(Request(text, SamplingParams(), slot=0), len(text))
    for layer in range(runner.draft_cache.k.shape[0]):
        assert torch.allclose(runner.draft_cache.k[layer, req.slot, :n], fresh.runner.draft_cache.k[layer, 0, :n],
                              atol=1e-9)


# ---- the cost cache ---------------------------------------------------------------------

def test_cost_cache_is_written_reused_and_invalidated(pair, tmp_path):
    """The first engine measures and writes the cache; the next one with the same target, drafter,
    device, dtype and threads reads it without measuring; replacing the weights (a new mtime) or
    changing the thread count measures again."""
    target, drafter = pair
    cfg = dict(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64, max_budget=16,
               cost_cache=str(tmp_path / "cache"))
    before = cost_model.measurements
    first = LLMEngine(EngineConfig(**cfg)).runner
    assert first.policy.cost.source == "measured" and cost_model.measurements == before + 1
    assert first.cost_path.is_file() and first.cost_path.is_relative_to(tmp_path / "cache")
    again = LLMEngine(EngineConfig(**cfg)).runner
    assert again.policy.cost.source == "cache" and cost_model.measurements == before + 1
    assert np.allclose(again.policy.cost.verify.values, first.policy.cost.verify.values)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert LLMEngine(EngineConfig(**cfg)).runner.policy.cost.source == "measured"
    finally:
        torch.set_num_threads(threads)
    weights = next(target.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert LLMEngine(EngineConfig(**cfg)).runner.policy.cost.source == "measured"
    assert cost_model.measurements == before + 3
    # The startup measurement left every slot empty.
    assert again.cache.lengths == [0] * 8


def test_startup_times_only_the_work_it_names(pair, monkeypatch):
    """No timed function draws its own inputs: the chain build's timing once drew its random logits
    inside the timed call, 10x the build on the demo pair, and every tree was floored at it (a
    tree of 8 priced 3.9 ms for a 0.6 ms build at c = 4, a sixth of its round)."""
    target, drafter = pair
    draws = {"timed": 0, "inside": False}
    randn = torch.randn

    def counted(*args, **kwargs):
        draws["timed"] += draws["inside"]
        return randn(*args, **kwargs)

    timer_call = cost_model._Timer.__call__

    def timed(self, fn, repeats=2):
        draws["inside"] = True
        try:
            return timer_call(self, fn, repeats)
        finally:
            draws["inside"] = False

    monkeypatch.setattr(torch, "randn", counted)
    monkeypatch.setattr(cost_model._Timer, "__call__", timed)
    LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64, max_budget=16,
                           cost_cache="off"))
    assert draws["timed"] == 0


def test_tree_costs_follow_their_measured_points():
    """The tree table is the tree builds' own timings (interpolated), whatever the chain build took."""
    v = {(r, n): 1e-3 * r * n for r in (1, 4) for n in (1, 2, 3, 5)}
    tr = {(1, 4): 1e-4, (1, 16): 2e-4, (4, 4): 3e-4, (4, 16): 6e-4}
    model = cost_model._tables(v, {1: 1e-3, 4: 2e-3}, {1: 1e-4, 4: 4e-4}, tr, 5e-3, 4, [1, 2, 3, 5], [4, 16], 4, 5,
                               16, 0.0)
    for (r, b), s in tr.items():
        assert float(model.tree(r, b)) == pytest.approx(s)


def test_cost_cache_location(monkeypatch, tmp_path):
    """$FLASHTREE_CACHE_DIR wins, then $XDG_CACHE_HOME/flashtree, then ~/.cache/flashtree; "off" disables."""
    monkeypatch.setenv("FLASHTREE_CACHE_DIR", str(tmp_path / "a"))
    assert cost_model.cache_dir(None) == tmp_path / "a"
    monkeypatch.delenv("FLASHTREE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cost_model.cache_dir(None) == tmp_path / "x" / "flashtree"
    assert cost_model.cache_dir(str(tmp_path / "b")) == tmp_path / "b"
    assert cost_model.cache_dir("off") is None


def test_metrics_expose_the_policy():
    """/metrics counts each request-round's choice and histograms its drafted nodes, the accepted
    drafted tokens the policy expected, and those the target accepted (speculating rounds only)."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from flashtree.engine.llm_engine import RoundInfo
    from flashtree.server.metrics import ServerMetrics

    info = RoundInfo(3, 0.01, [4, 1, 2], ["tree", "ar", "chain"], [16, 0, 15], [2.5, 0.0, 1.25])
    engine = SimpleNamespace(stats=lambda: SimpleNamespace(last_round=info))
    m = ServerMetrics()
    m.observe_round(engine, [])
    text = generate_latest(m.registry).decode()
    for line in ('flashtree_policy_rounds_total{choice="tree"} 1.0', 'flashtree_policy_rounds_total{choice="ar"} 1.0',
                 'flashtree_policy_rounds_total{choice="chain"} 1.0', "flashtree_policy_draft_nodes_count 3.0",
                 "flashtree_policy_draft_nodes_sum 31.0", "flashtree_policy_predicted_accepted_sum 3.75",
                 "flashtree_policy_predicted_accepted_count 2.0", "flashtree_policy_accepted_sum 4.0"):
        assert line in text, line
