"""budget="auto": the speculation policy. It never changes output, drafts only for the rows it
speculates for, starts safely (AR steps or the chain, as the cost model says), measures every
smaller tree from a verified one, follows measured acceptance and cost to AR steps and back, plans
uniform and mixed batches alike, and caches its cost model on disk. Also the exactness of the trees
it relies on: cut and per-row builds equal smaller builds, placed rows keep their nodes."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from flashtree import LLM, EngineConfig, LLMEngine, SamplingParams
from flashtree.engine import cost_cache, cost_model
from flashtree.engine.cost_model import Grid
from flashtree.engine.policy import (BASE, FORGET, HOLD, PROBE, PROBE_TOKENS, REUSE, SCOUT, SETTLE_ROUNDS, SETTLE_ROWS,
                                     Policy, by_size, sampling_class)
from flashtree.engine.round_plan import AR, CHAIN, RoundPlan, fixed_plan
from flashtree.engine.runner import path_codes
from flashtree.engine.sequence import Request
from flashtree.tree import TreeSpec, accept_walk, build_chain, build_tree
from flashtree.tree.budget import truncate
from flashtree.tree.mix import place_rows, root_only
from tiny import make_drafter, make_target, synthetic_cost

FIELDS = ("tokens", "parents", "depths", "sizes", "scores")


def _same(a, b, rows=None) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        x = x.expand_as(a.tokens) if x.dim() == 2 else x
        y = y.expand_as(b.tokens) if y.dim() == 2 else y
        if rows is not None:
            x = x[rows]
        assert torch.equal(x, y), f


def _padded(spec: TreeSpec, n: int) -> TreeSpec:
    """spec with n nodes per row, the builders' padding (token -1, parent 0, depth 1, score -inf)."""
    R, N = spec.tokens.shape

    def widen(x, fill):
        return torch.cat([x.expand(R, N), x.new_full((R, n - N), fill)], 1)

    return TreeSpec(widen(spec.tokens, -1), widen(spec.parents, 0), widen(spec.depths, 1), spec.sizes,
                    is_chain=False, scores=widen(spec.scores, float("-inf")))


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
    scoring only the first b depths (the runner trims the drafter's LM head) changes nothing:
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
            alone = _padded(build_tree(roots[r : r + 1], logits[r : r + 1], b), 21)
            for f in ("tokens", "parents", "depths", "scores"):
                assert torch.equal(getattr(mixed, f)[r], getattr(alone, f)[0]), (trial, r, f)
            assert int(mixed.sizes[r]) == int(alone.sizes[0])
        for b in range(1, D + 1):
            _same(build_tree(roots, logits[:, :b], b), build_tree(roots, logits, b))


def test_placed_rows_keep_their_nodes():
    """Drafted rows (a tree, or a chain) placed among lone roots keep every node of their builds,
    and the lone roots are plain AR rows (one node, the rest padding)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 9, generator=g) * 2
    roots = torch.arange(10, 15)
    rows = torch.tensor([3, 0])
    tree = build_tree(roots[rows], logits, 7)
    window = place_rows(root_only(roots, 8), rows, tree)
    _same(window, tree, rows=rows)
    chain = build_chain(roots[rows], logits)
    window = place_rows(root_only(roots, 7), rows, chain)
    assert torch.equal(window.tokens[rows], chain.tokens) and torch.equal(window.parents[3], torch.arange(-1, 6))
    for r in (1, 2, 4):
        assert window.tokens[r, 0] == roots[r] and (window.tokens[r, 1:] == -1).all() and window.sizes[r] == 1


def test_a_verified_tree_measures_every_smaller_one_and_the_chain():
    """by_size, from a big tree's accepted path codes, gives what each smaller top-b tree's own
    walk accepts (the target's picks fixed per depth, as seed-exact sampling fixes them), and the
    spine run gives the chain's whenever it is not cut short by the tree's spine."""
    g = torch.Generator().manual_seed(5)
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24]
    for trial in range(80):
        V, D = 4, 5
        logits = torch.randn(1, D, V, generator=g) * 2
        roots = torch.tensor([0])
        truth = torch.randint(0, V, (D + 1,), generator=g)  # the target's token at each depth
        big = build_tree(roots, logits, 24)

        def walked(spec):
            picks = truth[spec.depths.expand_as(spec.tokens).clamp(max=D)]
            return accept_walk(spec, picks)

        walk = walked(big)
        counts, run, censored = by_size(path_codes(big, walk.path)[0].tolist(), sizes)
        for b, got in zip(sizes, counts):
            assert got == int(walked(build_tree(roots, logits, b)).num_nodes[0]) - 1, (trial, b)
        if not censored:
            assert run == int(walked(build_chain(roots, logits)).num_nodes[0]) - 1, trial


# ---- the policy on synthetic costs --------------------------------------------------------

def _requests(n: int, temperature: float = 0.0, first: int = 0, tokens: int = PROBE_TOKENS) -> list[Request]:
    """n requests in slots first.., each `tokens` into its output (by default past the first round
    after its prompt, which teaches only the request)."""
    reqs = [Request([1, 2], SamplingParams(temperature=temperature)) for _ in range(n)]
    for i, r in enumerate(reqs):
        r.slot = first + i
        r.output_ids = [5] * tokens
    return reqs


def _feed(policy: Policy, plan: RoundPlan, reqs: list[Request], accept: float, slow: float = 1.0) -> None:
    """Pretend the round ran: the target accepts each drafted depth with probability `accept`
    (geometric: depth d with accept^d, so bigger trees add less), and the round took `slow` times
    the cost model's seconds."""
    D = policy.depth
    curve = np.cumsum(accept ** np.arange(1, D + 1))
    accepted = [0] * len(reqs)
    measured = None
    if plan.tree_rows:
        counts = [float(curve[min(b, D) - 1]) for b in policy.grid[: plan.measure]]
        measured = [(counts, float(curve[-1]), False)] * plan.drafting
        for i in plan.draft_rows:
            accepted[i] = round(counts[-1])
    elif plan.drafting:
        for i in plan.draft_rows:
            accepted[i] = round(float(curve[-1]))
    policy.observe(plan, [r.slot for r in reqs], accepted, measured, (plan.seconds or 0.01) * slow)


def _replan(policy: Policy, reqs: list[Request]) -> RoundPlan:
    """A fresh plan for `reqs`, not the one a lone request's last plan holds for its next round (REUSE):
    for tests that change the policy's state between plans."""
    policy.hold = ([], 0)
    return policy.plan(reqs)


def _run(policy: Policy, reqs: list[Request], accept: float, rounds: int) -> list[RoundPlan]:
    plans = []
    for _ in range(rounds):
        plans.append(policy.plan(reqs))
        _feed(policy, plans[-1], reqs, accept)
    return plans


def _requests_in_turn(policy: Policy, n: int, accept: float, rounds: int) -> None:
    """n requests of one class, one after another in slot 0, each for `rounds` rounds: a class learns
    from many requests (each one's own runs soon decide its own rounds)."""
    for _ in range(n):
        _run(policy, _requests(1), accept=accept, rounds=rounds)


def test_a_fresh_policy_starts_from_the_chain_or_ar_as_the_cost_model_says():
    """No evidence yet: the first rounds play the chain where the cost model says it pays with
    half its depth kept, AR steps where it does not; never an exploration tree, whatever the batch."""
    for batch in (1, 8, 16):
        cheap = Policy(synthetic_cost(1e-5, draft=5e-4), 16, 16, 64, 4096)  # a chain round costs little more than AR
        plans = _run(cheap, _requests(batch), accept=0.9, rounds=4)
        assert plans[0].modes == [CHAIN] * batch, batch
        dear = Policy(synthetic_cost(2e-2, draft=0.2), 16, 16, 64, 4096)  # a chain round costs 10x an AR step
        plans = _run(dear, _requests(batch), accept=0.9, rounds=4)
        assert all(p.modes == [AR] * batch for p in plans), batch


def test_a_fresh_engine_at_batch_8_picks_no_tree_wider_than_pays(tmp_path):
    """A fresh engine's first rounds at batch 8, on its own measured cost model: the first drafting
    round is the chain, and every drafting round is one the cost model predicted to beat AR steps
    with what the policy expected it to keep, or an exploration paid from credit it had earned."""
    target = make_target(tmp_path / "t", vocab=32, logit_scale=3.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=32, block_size=8)
    engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=96,
                                    max_batch=8, max_budget=64, cost_cache="off"))
    runner, policy = engine.runner, engine.runner.policy
    seen = []  # per round: AR's seconds for the batch, the credit before it, and the plan
    plan = runner.plan

    def recorded(reqs):
        credit = min(policy._stats(policy.cls[r.slot]).credit for r in reqs) if policy.classes else 0.0
        p = plan(reqs)
        seen.append((policy.seconds(len(reqs))[0], credit, p))
        return p

    runner.plan = recorded
    for i in range(8):
        engine.add_request([1 + i, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    drafting = [(ar, credit, p) for ar, credit, p in seen if p.drafting]
    assert not drafting or drafting[0][2].tree_rows == 0  # none at all where this machine's costs say so
    for ar_seconds, credit, p in drafting:
        rows = len(p.modes)
        tokens = rows + sum(p.predicted)
        pays = tokens / p.seconds > rows / ar_seconds
        # else an exploration: what it loses against AR steps' rate (its tokens, at that rate) was covered
        assert pays or p.seconds - tokens * ar_seconds / rows <= credit + 1e-12


def test_measured_acceptance_moves_the_plan_with_cost_and_batch():
    """Cheap verify nodes and high acceptance: trees; the same acceptance at batch 16 on dearer
    nodes buys a smaller window; nothing accepted: AR steps."""
    rich = Policy(synthetic_cost(1e-5), 16, 16, 64, 4096)
    plans = _run(rich, _requests(1), accept=0.95, rounds=400)
    assert plans[-1].drafting == 1 and plans[-1].window >= 16
    busy = Policy(synthetic_cost(1e-4), 16, 16, 64, 4096)
    plans_busy = _run(busy, _requests(16), accept=0.95, rounds=400)
    assert plans_busy[-1].window < plans[-1].window
    dead = Policy(synthetic_cost(1e-4), 16, 16, 64, 4096)
    plans = _run(dead, _requests(4), accept=0.0, rounds=200)
    assert sum(p.drafting > 0 for p in plans[100:]) <= 2


def test_exploration_costs_at_most_its_probe_share_where_nothing_pays():
    """Drafts never accepted: the time spent on drafting rounds after the first chain rounds is
    paid from PROBE of the time, a few percent at most."""
    policy = Policy(synthetic_cost(1e-4), 16, 16, 64, 4096)
    reqs = _requests(4)
    plans = _run(policy, reqs, accept=0.0, rounds=2000)
    ar_seconds = policy.seconds(4)[0]
    extra = sum(p.seconds - ar_seconds for p in plans[20:] if p.drafting)
    total = sum(p.seconds or ar_seconds for p in plans[20:])
    assert extra <= 2 * PROBE * total + 1e-9


def test_a_uniform_batch_is_planned_as_the_per_row_path_plans_it(monkeypatch):
    """One planner: a batch whose requests sample alike gets the plan it gets when its rows are
    two classes with the same measured statistics (exploration off: it spends per class)."""
    import flashtree.engine.policy as policy_module

    monkeypatch.setattr(policy_module, "EXPLORE", 0.0)
    monkeypatch.setattr(policy_module, "PROBE", 0.0)
    one = Policy(synthetic_cost(3e-5), 16, 16, 64, 4096)
    two = Policy(synthetic_cost(3e-5), 16, 16, 64, 4096)
    uniform = _requests(6, temperature=0.5)
    mixed = _requests(3, temperature=0.5) + _requests(3, temperature=0.6, first=3)
    warm = _requests(1, temperature=0.5, first=10)
    for p in (one, two):
        _run(p, warm, accept=0.8, rounds=60)
    two.classes[6] = two.classes[5]  # the second class has measured exactly what the first one has
    for _ in range(20):
        a, b = one.plan(uniform), two.plan(mixed)
        assert (a.modes, a.window, a.draft_rows, a.predicted) == (b.modes, b.window, b.draft_rows, b.predicted)
        _feed(one, a, uniform, accept=0.8)
        _feed(two, b, mixed, accept=0.8)


def _own_estimates(policy: Policy, slots: list[int], classes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The rows' levels and the weights of their own chain runs, as a plan works them out."""
    own_level, own_run = policy._own(np.array(slots))
    return policy._levels(np.array(slots), classes, own_level), own_run


def test_a_request_is_predicted_from_its_own_chain_runs():
    """Two greedy requests whose spines both keep their first 3 tokens (the same level), then one runs
    on to all 15 and the other stops. The class's shape alone predicts them alike; each one's own
    runs tell them apart, and where each drafting row costs what ~3 AR steps do, only the long one drafts."""
    policy = Policy(synthetic_cost(1e-4, draft=0.03), 16, 16, 64, 4096)
    long, short = _requests(1), _requests(1, first=1)
    chain = policy.arm_plan(policy.chain_arm, 1)
    for _ in range(30):
        for reqs, run in ((long, 15), (short, 3)):
            policy.plan(reqs)
            policy.observe(chain, [reqs[0].slot], [run], None, 0.05)
    levels, runs = _own_estimates(policy, [0, 1], [0, 0])
    assert levels[0] == levels[1]
    pooled, _ = policy.expected([0, 0], levels)
    assert pooled[0, -1] == pooled[1, -1]
    own, _ = policy.expected([0, 0], levels, np.array([0, 1]), runs)
    assert own[0, -1] > 12 and own[1, -1] < 4
    for st in policy.classes.values():
        st.credit = 0.0  # no exploration round now
    plan = policy.plan(long + short)
    assert plan.draft_rows == [0] and plan.modes[1] == AR


def test_a_request_held_on_ar_steps_drafts_again_as_its_own_evidence_fades():
    """A request whose last rounds kept nothing, in a class whose chain keeps much, goes to AR steps;
    held no more than FORGET rounds at a time, and its own runs weighing half as much every FORGET
    tokens, it drafts again on its class's estimate alone, with no credit for a probe (acceptance
    comes in stretches: the hard one it left says less and less of where it is now)."""
    policy = Policy(synthetic_cost(1e-4, draft=0.03), 16, 16, 64, 4096)
    _requests_in_turn(policy, 40, accept=0.95, rounds=20)
    req = _requests(1)
    for _ in range(40):  # a hard stretch: the drafts keep nothing, a token a round
        plan = policy.plan(req)
        if not plan.drafting:
            break
        _feed(policy, plan, req, accept=0.0)
        req[0].output_ids.append(5)
    assert plan.drafting == 0
    for st in policy.classes.values():
        st.credit = -1.0  # no probe, no exploration: only the fading evidence can end the AR steps
    longest, tokens = policy.hold[1], len(req[0].output_ids)
    while (plan := policy.plan(req)).drafting == 0:
        longest = max(longest, policy.hold[1])
        req[0].output_ids.append(5)
        assert len(req[0].output_ids) < tokens + 6 * FORGET, "still on AR steps"
    assert not plan.explored and plan.modes == [CHAIN]
    assert 0 < longest <= FORGET
    assert len(req[0].output_ids) > tokens + FORGET // 2  # the hard stretch did hold it a while


def test_ar_steps_are_decided_further_ahead_where_the_class_would_not_draft_either():
    """Where even its class's estimate would not draft, a held request's fading evidence cannot bring it
    back, so AR steps are decided HOLD rounds ahead, not FORGET (each plan is a visible share of an AR
    step); a class whose chain pays still holds a request its own hard stretch sent to AR steps at most
    FORGET rounds."""
    for accept, longer in ((0.0, True), (0.95, False)):
        policy = Policy(synthetic_cost(1e-4, draft=0.03), 16, 16, 64, 4096)
        _requests_in_turn(policy, 40, accept=accept, rounds=20)
        req = _requests(1, tokens=64)
        req[0].params = SamplingParams(max_tokens=4096)
        for _ in range(40):
            plan = _replan(policy, req)
            if not plan.drafting:
                break
            _feed(policy, plan, req, accept=0.0)
            req[0].output_ids.append(5)
        for st in policy.classes.values():
            st.credit = -1.0  # no exploration
        assert _replan(policy, req).drafting == 0
        assert policy.hold[1] == (HOLD if longer else FORGET) and HOLD > FORGET, accept


def test_a_lone_requests_drafting_plan_is_played_for_its_next_round_too():
    """Planning a lone request is a visible share of its round (batch 1 on a small model), and its plan
    seldom changes from one round to the next: a drafting plan is played REUSE rounds before the next is
    made, every round observed as usual; an exploration is played once, and a batch of two is planned
    every round."""
    policy = Policy(synthetic_cost(1e-4), 16, 16, 64, 4096)
    reqs = _requests(1)
    calls = []
    expected = policy.expected
    policy.expected = lambda *a: (calls.append(1), expected(*a))[1]
    plans = []
    for _ in range(3 * REUSE):
        for st in policy.classes.values():
            st.credit = -1.0  # no exploration yet
        plans.append(policy.plan(reqs))
        _feed(policy, plans[-1], reqs, accept=0.9)
        reqs[0].output_ids.append(5)
    assert all(p.drafting and not p.explored for p in plans)
    assert len(calls) == 3 and all(plans[i] is plans[i - i % REUSE] for i in range(len(plans)))
    for st in policy.classes.values():
        st.credit = 10.0  # enough to explore
    explore = _replan(policy, reqs)
    assert explore.explored
    calls.clear()
    assert policy.plan(reqs) is not explore and calls == [1]
    pair = _requests(2)
    calls.clear()
    for _ in range(3):
        _feed(policy, policy.plan(pair), pair, accept=0.9)
    assert len(calls) == 3


def test_estimates_are_scaled_by_what_the_rows_chosen_on_them_kept():
    """Sampled rows chosen to draft on their estimates keep 1 token where 8 were predicted (estimates run
    high where noise put them high): every estimate of the class is scaled by kept / predicted, and the
    chain is no longer played where only the unscaled estimate pays. Explorations teach no scale, nor
    do greedy rows, whose acceptance follows the text."""
    calibrated, plain = (Policy(synthetic_cost(1e-4, draft=0.03), 16, 16, 64, 4096) for _ in range(2))
    reqs = _requests(1, temperature=0.7)
    chosen = replace(calibrated.arm_plan(calibrated.chain_arm, 1), predicted=[8.0], seconds=0.05)
    for policy in (calibrated, plain):
        policy.plan(reqs)
        for _ in range(30):
            policy.observe(chosen, [0], [1], None, 0.05)
            policy.observe(replace(chosen, explored=True, baseline=100.0), [0], [9], None, 0.05)
    plain.classes[7].calibration[:] = (1.0, 1.0, 0.0)
    levels, runs = _own_estimates(calibrated, [0], [7])
    scaled, _ = calibrated.expected([7], levels, np.array([0]), runs)
    unscaled, _ = plain.expected([7], levels, np.array([0]), runs)
    factor = scaled[0, -1] / unscaled[0, -1]
    assert factor < 0.5
    assert np.allclose(scaled, np.minimum(unscaled * factor, calibrated.cap))
    for policy in (calibrated, plain):
        for st in policy.classes.values():
            st.credit = 0.0  # no exploration round now
    assert _replan(plain, reqs).drafting and not _replan(calibrated, reqs).drafting
    greedy = Policy(synthetic_cost(1e-4, draft=0.03), 16, 16, 64, 4096)
    greedy.plan(_requests(1))
    greedy.observe(chosen, [0], [1], None, 0.05)
    assert greedy.classes[0].calibration.tolist() == [1.0, 1.0, 0.0]


def test_a_mixed_batch_drafts_only_the_rows_that_pay():
    """Greedy rows whose drafts are kept and sampled rows whose drafts never are: the plan drafts
    the greedy rows and leaves the others on AR steps in the same round."""
    policy = Policy(synthetic_cost(3e-5), 16, 16, 64, 4096)
    greedy, sampled = _requests(4), _requests(4, temperature=1.0, first=4)
    _run(policy, greedy, accept=0.9, rounds=80)
    _run(policy, sampled, accept=0.0, rounds=200)
    for st in policy.classes.values():
        st.credit = 0.0  # no exploration round now
    plan = policy.plan(greedy + sampled)
    assert plan.draft_rows == [0, 1, 2, 3]
    assert all(plan.modes[i] == AR for i in range(4, 8))


def test_tree_rounds_measure_every_smaller_tree_for_the_class():
    """One round of a tree of 32 gives the class a measured shape for every size up to it, and the
    chain a measured run along the tree's spine."""
    policy = Policy(synthetic_cost(1e-5), 16, 16, 64, 4096)
    reqs = _requests(2)
    policy.plan(reqs)  # seats them
    plan = policy.arm_plan(policy.grid.index(32), 2)
    _feed(policy, plan, reqs, accept=0.9)
    st = policy.classes[0]
    j = policy.grid.index(32)
    rows = st.rows.sum(1)  # over the level bins
    assert (rows[: j + 1] == 2).all() and (rows[j + 1 : -1] == 0).all()  # two rows each
    assert rows[policy.chain_arm] == 2


def test_a_tree_is_judged_against_the_chain_at_the_rows_level():
    """A tree of 16 keeps 5 more than the chain on rows whose chain keeps 1 (a request's early
    rounds) and 1 less on rows whose chain keeps 14 (its later rounds). Fed both, the policy plays
    the tree for a row at the low level and the chain for a row at the high level, where a tree's
    acceptance pooled over both (as shapes were) would play the tree for both."""
    policy = Policy(synthetic_cost(3e-5), 16, 16, 64, 4096)
    low, high = _requests(1), _requests(1, first=1)
    sizes = policy.grid[: policy.grid.index(16) + 1]  # 1, 2, 3, 4, 6, 8, 12, 16
    early = ([1, 1, 2, 2, 3, 4, 5, 6], 1, False)  # per size, the drafted tokens the top-b tree keeps; the spine's run
    later = ([min(b, 13) for b in sizes], 14, False)
    assert sum(early[0]) and len(early[0]) == len(sizes)
    policy.plan(low + high)  # seats them
    plan = policy.arm_plan(policy.grid.index(16), 2)
    for _ in range(40):
        policy.plan(low + high)  # a round is planned first: observe teaches each row's level bin as planned
        policy.observe(plan, [0, 1], [6, 13], [early, later], plan.seconds or 0.01)
    for st in policy.classes.values():
        st.credit = 0.0  # no exploration
    assert policy.plan(high).arm == policy.chain_arm
    tree = policy.plan(low)
    assert tree.arm == policy.grid.index(16) and not tree.explored


def test_the_chain_is_measured_along_tree_spines_where_they_end_first():
    """The chain keeps each next token with probability 0.8 (7.2 of 15 on average). Tree rounds
    show its run only up to their spine's end, 6 nodes deep here; the survival by depth still
    predicts 7.2 at the class's level, where the runs as seen average under 3."""
    rng = np.random.default_rng(0)
    policy = Policy(synthetic_cost(1e-5), 16, 16, 64, 4096)
    st = policy._stats(0)
    seen = []
    for i in range(4000):
        run = next((d for d, ok in enumerate(rng.random(15) < 0.8) if not ok), 15)
        if i % 4:  # a tree round: the spine ends at depth 6
            st.chain_run(min(run, 6), run >= 6)
            seen.append(min(run, 6))
        else:
            st.chain_run(run, False)
        st.leveled(min(run, 3))
    truth = sum(0.8 ** d for d in range(1, 16))
    assert abs(st.shape * (st.level + 0.5) - truth) < 0.6
    assert np.mean(seen) < 3


def test_a_requests_opening_has_statistics_of_its_own():
    """Openings (a request's first PROBE_TOKENS tokens, right after its prompt) that keep nothing
    put new requests' openings on AR steps, while the same class's later rounds, which keep
    much, go on drafting the moment a request leaves its opening."""
    policy = Policy(synthetic_cost(3e-4, draft=0.03), 16, 16, 64, 4096)  # the chain pays from ~4 tokens kept
    opening = _requests(2, tokens=0)
    for _ in range(20):
        policy.plan(opening)  # seats them
        _feed(policy, policy.arm_plan(policy.chain_arm, 2), opening, accept=0.0)
    _run(policy, _requests(2, first=2), accept=0.9, rounds=200)  # a probe measures the class (paid from credit)
    assert policy.classes[-1].level < 1.5 < policy.classes[0].level  # both started at the prior, 1.5
    for st in policy.classes.values():
        st.credit = 0.0  # no exploration
    new = _requests(1, first=4, tokens=0)
    drafted = []
    for t in range(PROBE_TOKENS + 1):  # an AR step a token
        new[0].output_ids = [5] * t
        drafted.append(policy.plan(new).drafting)
    assert drafted == [0] * PROBE_TOKENS + [1]


def test_exploration_plays_the_largest_thin_tree_only():
    """With credit to spare and no tree measured, the exploration round is the largest tree that
    fits (it measures every smaller one); short of the credit for it, no smaller tree is played
    instead."""
    policy = Policy(synthetic_cost(3e-4), 16, 16, 64, 4096)
    reqs = _requests(1)
    policy.plan(reqs)
    st = policy.classes[0]
    st.rows[policy.chain_arm] = 100  # the chain is known; every tree is thin
    st.credit = 10.0
    assert _replan(policy, reqs).arm == policy.grid.index(64)
    # Credit between what a tree of 2 and the tree of 64 are predicted to lose: no exploration.
    ar_seconds, table = policy.seconds(1)
    gains, _ = policy.expected([0], np.array([st.level]))
    best = max(1 / ar_seconds, policy._best(gains, table, 1)[2])
    loss = {b: table[policy.grid.index(b), 1] - (1 + gains[0, policy.grid.index(b)]) / best for b in (2, 64)}
    assert loss[2] < loss[64]
    st.credit = (max(loss[2], 0.0) + loss[64]) / 2
    plan = _replan(policy, reqs)
    assert not plan.explored


def test_an_exploration_pays_its_loss_against_the_plan_it_displaced():
    """Where the chain pays, an exploration tree is charged what it lost against the chain's rate,
    not only what it lost against AR steps (a tree that beat AR steps but not the chain was free,
    and a fresh engine at T = 0, batch 4 explored trees of 64 five times, 11% of its time)."""
    policy = Policy(synthetic_cost(4e-4, draft=5e-4), 16, 16, 64, 4096)
    reqs = _requests(4)
    charged = []
    for _ in range(300):
        credit = policy._stats(0).credit
        plan = policy.plan(reqs)
        _feed(policy, plan, reqs, accept=0.9)
        if plan.explored and plan.arm != policy.chain_arm:
            ar_rate = 4 / policy.ar_seconds(4)
            charged.append((plan.baseline, ar_rate, credit + PROBE * plan.seconds - policy._stats(0).credit))
    assert charged
    for baseline, ar_rate, paid in charged:
        assert baseline > 1.5 * ar_rate  # the chain's rate, which the exploration displaced
        assert paid > 0  # it lost against it, and the credit paid for that


def test_a_request_on_ar_steps_is_probed_with_the_chain_each_time_its_output_doubles():
    """A class whose requests kept nothing is on AR steps; a new request in its slot drafts the
    chain once after its first PROBE_TOKENS tokens (an exploration, paid from credit), and what
    it keeps decides its next rounds: all kept, it goes on drafting; nothing kept, AR steps, and
    another probe once its output has doubled (a request's later text is often guessed better)."""

    def probe_credit(policy, req):  # enough for the chain's predicted loss, short of exploring the tree of 64
        ar_seconds, table = policy.seconds(1)
        levels, runs = _own_estimates(policy, [req.slot], [0])
        gains = policy.expected([0], levels, np.array([req.slot]), runs)[0][0]
        loss = table[:, 1] - (1 + gains) * ar_seconds
        assert loss[policy.grid.index(64)] > 1.01 * loss[policy.chain_arm]
        policy.classes[0].credit = 1.01 * max(loss[policy.chain_arm], 0.0)

    for accept, drafts_on in ((0.95, True), (0.0, False)):
        policy = Policy(synthetic_cost(1e-5, draft=2e-3), 16, 16, 64, 4096)
        _requests_in_turn(policy, 40, accept=0.0, rounds=20)
        _run(policy, _requests(1, first=1, tokens=0), accept=0.0, rounds=400)  # openings too
        assert policy.plan(_requests(1, tokens=0)).drafting == 0
        new = _requests(1, tokens=0)
        probe_credit(policy, new[0])
        new[0].output_ids = [5] * (PROBE_TOKENS - 1)
        assert policy.plan(new).drafting == 0  # too early: a request's first rounds keep little
        new[0].output_ids = [5] * PROBE_TOKENS
        probe = policy.plan(new)
        assert probe.explored and probe.modes == [CHAIN]
        _feed(policy, probe, new, accept=accept)
        assert (policy.plan(new).drafting > 0) == drafts_on
    probe_credit(policy, new[0])
    for t in range(PROBE_TOKENS + 1, 2 * PROBE_TOKENS):  # an AR step a token
        new[0].output_ids = [5] * t
        assert policy.plan(new).drafting == 0
    new[0].output_ids = [5] * (2 * PROBE_TOKENS)
    again = policy.plan(new)
    assert again.explored and again.modes == [CHAIN]


def test_a_class_seats_plain_only_if_none_of_its_recent_requests_would_draft():
    """A class whose average request does not pay still seats new requests speculative while
    one of its recent requests kept enough to pay; once its recent requests all kept nothing,
    new ones are seated plain (all but the scouts)."""
    policy = Policy(synthetic_cost(1e-5, draft=5e-4), 16, 16, 64, 4096)
    _requests_in_turn(policy, 40, accept=0.0, rounds=80)
    st = policy.classes[0]
    assert st.level_rows >= SETTLE_ROWS and not policy.admit(SamplingParams(), 1)
    st.recent = [0.0, 3.0]  # one recent request kept its whole base every round
    assert all(policy.admit(SamplingParams(), 1) for _ in range(SCOUT))
    st.recent = [0.0, 0.0]
    assert sum(policy.admit(SamplingParams(), 1) for _ in range(4 * SCOUT)) <= 4


def test_a_class_that_pays_for_a_few_rows_of_a_batch_seats_requests_speculative():
    """admit judges a batch as the planner does, with any number of its rows drafting: where the
    drafter's pass is cheap for one or two rows and dear for sixteen, the chain pays for a few rows of
    a batch of 16 but not for all of them, and a request joining that batch may draft."""
    cost = synthetic_cost(1e-5)
    cost.draft = Grid([1, 2, 16], [0, 15], [[1e-3, 1.2e-3], [2e-3, 2.4e-3], [0.5, 0.6]])
    policy = Policy(cost, 16, 16, 64, 4096)
    st = policy._stats(0)
    st.level, st.level_rows = float(BASE), float(SETTLE_ROWS)  # measured, and keeping its whole base
    ar_seconds, table = policy.seconds(16)
    gains = policy.expected([0], [st.level])[0][0]
    chain = policy.chain_arm
    assert (16 + 16 * gains[chain]) / table[chain, 16] < 16 / ar_seconds < (16 + gains[chain]) / table[chain, 1]
    assert all(policy.admit(SamplingParams(), 16) for _ in range(2 * SCOUT))


def test_frozen_costs_plan_alike_whatever_each_rank_timed():
    """Tensor parallelism freezes the cost model: two policies fed the same rounds with different
    wall times (each rank's own) make the same plans."""
    a, b = Policy(synthetic_cost(3e-5), 16, 16, 64, 4096), Policy(synthetic_cost(3e-5), 16, 16, 64, 4096)
    a.cost.frozen = b.cost.frozen = True
    reqs = _requests(4)
    for i in range(200):
        pa, pb = a.plan(reqs), b.plan(reqs)
        assert (pa.modes, pa.window, pa.draft_rows) == (pb.modes, pb.window, pb.draft_rows)
        _feed(a, pa, reqs, accept=0.7, slow=1.0)
        _feed(b, pb, reqs, accept=0.7, slow=1.0 + (i % 3))


def test_a_settled_class_seats_plain_requests_but_scouts():
    """A class measured where no arm pays: new requests are seated plain, all but one in SCOUT."""
    policy = Policy(synthetic_cost(1e-5, draft=5e-4), 16, 16, 64, 4096)
    _run(policy, _requests(4), accept=0.0, rounds=8000)
    assert policy.classes[0].level_rows >= SETTLE_ROWS
    seated = [policy.admit(SamplingParams(), 4) for _ in range(4 * SCOUT)]
    assert sum(seated) == 4
    fresh = Policy(synthetic_cost(1e-5, draft=5e-4), 16, 16, 64, 4096)
    assert all(fresh.admit(SamplingParams(), 4) for _ in range(SCOUT))  # nothing measured: all may draft


def test_a_class_its_plans_keep_on_ar_steps_settles_after_its_rounds():
    """Where drafting keeps nothing, the planner soon takes AR steps, which measure nothing: the class
    never reaches SETTLE_ROWS measured rows, so after SETTLE_ROUNDS rounds it seats new requests plain
    (but scouts) instead of paying the drafter's upkeep for every request while its plans never draft."""
    policy = Policy(synthetic_cost(1e-5, draft=3e-2), 16, 16, 64, 4096)  # a chain round costs ~4 AR steps
    sampled = SamplingParams(temperature=0.7)
    reqs = _requests(1, temperature=0.7)
    plans = _run(policy, reqs, accept=0.0, rounds=SETTLE_ROUNDS - 1)
    st = policy.classes[sampling_class(sampled)]
    assert plans[0].drafting and st.round == SETTLE_ROUNDS - 1  # it started from the chain ...
    assert st.level_rows + policy._stats(-1 - sampling_class(sampled)).level_rows < SETTLE_ROWS  # ... soon left
    assert all(policy.admit(sampled, 1) for _ in range(2 * SCOUT))  # too soon: every request may draft
    _run(policy, reqs, accept=0.0, rounds=1)
    assert sum(policy.admit(sampled, 1) for _ in range(4 * SCOUT)) == 4


# ---- the policy in the engine -------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    target = make_target(root / "t", vocab=16, logit_scale=3.0)
    return target, make_drafter(root / "d", target_layers=4, vocab=16, block_size=8)


def test_every_ar_step_counts_toward_its_class_settling(pair):
    """The engine observes one AR round in AR_TIMED_EVERY (observing them all cost a visible share of
    an AR step), and each one it observes counts for that many rounds of its class: a class its plans
    keep on AR steps settles after SETTLE_ROUNDS rounds, not four times as many, after which a short
    workload's new requests are seated plain instead of keeping the drafter's context on every step."""
    from flashtree.engine.runner import AR_TIMED_EVERY

    target, drafter = pair
    llm = LLM(str(target), str(drafter), device="cpu", max_model_len=256, max_batch=1, max_budget=16)
    policy = llm.engine.runner.policy
    policy.cost = synthetic_cost(2e-2, draft=0.2, rows=2)  # a chain round costs ~10 AR steps: AR steps only
    policy.cost.frozen = True
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=64, ignore_eos=True))[0]
    assert set(out.stats.modes) == {"ar"}
    assert out.stats.rounds - AR_TIMED_EVERY <= policy.classes[0].round <= out.stats.rounds + AR_TIMED_EVERY


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
    runner.policy.cost = synthetic_cost(2e-4, rows=4)
    runner.policy.cost.frozen = True  # prices stay the synthetic model's
    calls: list[int] = []
    forward = runner.drafter.forward
    runner.drafter.forward = lambda noise, ctx: (calls.append(noise.shape[0]), forward(noise, ctx))[1]
    rounds: list[tuple[int, int, int]] = []  # (rows, speculating rows, drafter rows) per round
    step = runner.step

    def counted(reqs):
        before = len(calls)
        out = step(reqs)
        rounds.append((len(reqs), runner.last_plan.drafting, sum(calls[before:])))
        return out

    runner.step = counted
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert all(drafter_rows == drafting for _, drafting, drafter_rows in rounds)
    late = rounds[len(rounds) // 3 :]
    assert sum(d for _, d, _ in late) <= 0.1 * sum(r for r, _, _ in late)
    modes = [m for o in out for m in o.stats.modes]
    assert modes.count("ar") / len(modes) > 0.8


def test_a_request_is_admitted_at_the_batch_it_will_run_in(tmp_path, monkeypatch):
    """Requests seated together are judged (Policy.admit) at the size of the batch they form, not
    at the last round's: after a lone request, a burst of three joins it as a batch of four. Each
    counts the others by the share of its own output they may overlap (max_tokens): beside three
    8-token requests, a 64-token one runs mostly alone, and is judged at one row."""
    target = make_target(tmp_path / "t", vocab=32)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=32, block_size=4)
    engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64,
                                    max_batch=4, max_budget=8))
    seen: list[int] = []
    admit = engine.runner.policy.admit
    monkeypatch.setattr(engine.runner.policy, "admit",
                        lambda params, rows, *a: (seen.append(rows), admit(params, rows, *a))[1])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request([1, 2, 3], params)
    engine.step()
    for p in ([4, 5], [6, 7], [8, 9]):
        engine.add_request(p, params)
    while engine.has_unfinished:
        engine.step()
    assert seen == [1, 4, 4, 4]
    seen.clear()
    for n in (8, 8, 8, 64):
        engine.add_request([1, 2], SamplingParams(max_tokens=n, ignore_eos=True))
    engine.step()
    assert seen == [4, 4, 4, 1]  # (8 + 8 + 8 + 64) / 64 rounds to 1


def _settling_engine(tmp_path, prompts: list[list[int]], params: SamplingParams, batch: int):
    """An engine whose class settles on AR steps (a drafter wrong by construction, a synthetic cost model
    where drafting loses), AR's outputs for `prompts`, and the slots its drafter is given context for."""
    target = make_target(tmp_path / "t", vocab=64, logit_scale=6.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=64, block_size=8, seed=7)
    ref = LLM(str(target), None, method="ar", device="cpu", max_model_len=96).generate(prompts, params)
    engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=96,
                                    max_batch=batch, max_budget=32))
    runner = engine.runner
    runner.policy.cost = synthetic_cost(2e-3, rows=batch)
    runner.policy.cost.frozen = True
    context_slots: list[int] = []
    add_context = runner.drafter.add_context
    runner.drafter.add_context = lambda ctx, f: (context_slots.extend(ctx.slots.tolist()), add_context(ctx, f))[1]
    return engine, ref, context_slots


def test_settled_class_seats_requests_the_drafter_never_sees(tmp_path, monkeypatch):
    """Once a class is settled on AR steps (a drafter wrong by construction, a synthetic cost
    model where drafting loses, and here a few rows of evidence enough to settle), new requests
    are seated plain: the drafter gets none of their prompt or tokens and no round drafts them,
    their rows in the held-back ring stay empty, a scout still may draft, and every output equals AR's."""
    import flashtree.engine.policy as policy_module

    monkeypatch.setattr(policy_module, "SETTLE_ROWS", 4)
    prompts = [[i, i + 1, i + 2] for i in range(1, 33)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine, ref, context_slots = _settling_engine(tmp_path, prompts, params, batch=2)
    runner = engine.runner
    drafted: list[bool] = []  # whether each row a round drafted was speculative then
    step = runner.step

    def counted(batch):
        out = step(batch)
        drafted.extend(batch[i].speculative for i in runner.last_plan.draft_rows)
        return out

    runner.step = counted
    seated_plain: list[Request] = []
    admit = runner.admit
    runner.admit = lambda req, running: (admit(req, running), req.speculative or seated_plain.append(req))[0]
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished:
        before = len(context_slots)
        engine.step()
        plain_slots = {r.slot for r in reqs if not r.speculative and not r.finished and r.num_computed}
        assert not plain_slots & set(context_slots[before:])
        assert all(runner.draft_cache.lengths[s] == 0 and runner.deferred.counts[s] == 0 for s in plain_slots)
    assert all(drafted)
    assert [r.output_ids for r in reqs] == [o.token_ids for o in ref]
    assert len(seated_plain) >= len(prompts) // 2  # most, once the class has settled
    assert all(set(r.stats.modes) == {"ar"} for r in seated_plain)
    assert 1 <= sum(r.speculative for r in reqs[-2 * SCOUT:]) <= 4  # the scouts


def test_requests_seated_before_their_class_settled_are_seated_plain_once_it_has(tmp_path, monkeypatch):
    """Requests that arrive together on a fresh engine are all seated speculative (their class has
    no evidence). Once the class settles on AR steps (a drafter wrong by construction, a synthetic
    cost model where drafting loses, and here a few timed rounds enough to settle), the runner
    seats them again as admit would: those it would seat plain stop keeping the drafter's context
    for the rest of their lives (no context appended, drafter rows and held-back ring emptied), and
    every output still equals AR's."""
    import flashtree.engine.policy as policy_module

    monkeypatch.setattr(policy_module, "SETTLE_ROUNDS", 4)  # rounds its plans keep on AR steps (timed ones)
    monkeypatch.setattr(policy_module, "SCOUT", 10**6)  # no scout: every running request may go plain
    prompts = [[i, i + 1, i + 2] for i in range(1, 5)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    engine, ref, context_slots = _settling_engine(tmp_path, prompts, params, batch=4)
    runner = engine.runner
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.step()
    assert all(r.speculative for r in reqs) and runner.provisional == {r.slot for r in reqs}
    demoted_at: dict[int, int] = {}
    while engine.has_unfinished:
        before = len(context_slots)
        engine.step()
        for r in reqs:
            if not r.speculative and not r.finished:
                demoted_at.setdefault(r.slot, len(r.output_ids))
                assert r.slot not in context_slots[before:]
                assert runner.draft_cache.lengths[r.slot] == 0 and runner.deferred.counts[r.slot] == 0
    assert demoted_at and all(n < params.max_tokens for n in demoted_at.values())  # while they ran
    assert not runner.provisional
    assert [r.output_ids for r in reqs] == [o.token_ids for o in ref]


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

def test_cost_cache_is_written_reused_and_invalidated(pair, tmp_path, monkeypatch):
    """The first engine measures and writes the cache; the next one with the same target, drafter,
    device, dtype and threads reads it without measuring; replacing the weights (a new mtime) or
    changing the thread count measures again. (Tables timed on a busy CPU are not cached, so the
    test does not depend on what else the machine runs.)"""
    monkeypatch.setattr(cost_cache, "QUIET", 0.0)
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
    # The whole rounds' prices are cached with the tables, and the start-up left every slot empty.
    assert np.array_equal(again.policy.cost.overhead.values, first.policy.cost.overhead.values)
    assert again.cache.lengths == [0] * 8
    assert first.cache.lengths == [0] * 8 and first.draft_cache.lengths == [0] * 8


def test_tables_timed_on_a_busy_cpu_are_used_but_not_cached(pair, tmp_path, monkeypatch):
    """Tables timed while the process had its core for less than QUIET of the wall time priced another
    job's load: the engine uses them, but writes no cache, so the next start measures again."""
    target, drafter = pair
    cfg = dict(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64, max_budget=16,
               cost_cache=str(tmp_path / "cache"))
    monkeypatch.setattr(cost_cache.time, "process_time", lambda: 0.0)  # no CPU time while the wall clock ran
    before = cost_model.measurements
    busy = LLMEngine(EngineConfig(**cfg)).runner
    assert busy.policy.cost.source == "measured" and busy.cost_path is None
    assert not (tmp_path / "cache").exists()
    monkeypatch.undo()
    monkeypatch.setattr(cost_cache, "QUIET", 0.0)  # quiet, whatever else this machine runs now
    quiet = LLMEngine(EngineConfig(**cfg)).runner
    assert quiet.policy.cost.source == "measured" and quiet.cost_path.is_file()
    assert cost_model.measurements == before + 2


def test_refinements_learned_on_a_busy_cpu_are_not_saved(pair, tmp_path, monkeypatch):
    """After SAVE_AFTER refinements the engine rewrites the cost cache with what it learned, but not
    when its timed rounds had the CPU for less than QUIET of their wall time: they priced another
    job's load, which every later start would then plan by."""
    from flashtree.engine import runner as runner_module

    monkeypatch.setattr(runner_module, "SAVE_AFTER", 2)
    target, drafter = pair
    cfg = dict(target=str(target), drafter=str(drafter), device="cpu", max_model_len=256, max_budget=16,
               max_batch=1, cost_cache=str(tmp_path / "cache"))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    process_time = time.process_time
    for busy in (True, False):
        monkeypatch.setattr(cost_cache, "QUIET", 0.0)  # start-up's tables are cached whatever the machine runs
        llm = LLM(**cfg)
        runner = llm.engine.runner
        written = runner.cost_path.read_text()
        monkeypatch.setattr(cost_cache, "QUIET", 0.8 if busy else 0.0)  # the rule the rounds are held to
        if busy:  # no CPU time passes while the rounds run
            monkeypatch.setattr(runner_module.time, "process_time", lambda: 0.0)
        llm.generate([[1, 2, 3]] * 6, params)
        monkeypatch.setattr(runner_module.time, "process_time", process_time)
        assert runner.policy.cost.refined >= 2
        assert (runner.cost_path.read_text() == written) == busy


def test_startup_prices_whole_rounds_by_their_excess_over_the_stage_tables(pair, monkeypatch):
    """A fresh engine times AR steps, the chain and a 16-node tree as whole rounds at every row point,
    and the overhead cells hold what each took past the stage tables' price, so a drafting round's
    price is what it was timed at, not its stages' sum; never below zero (a round with fewer rows
    drafting than were timed would take a negative correction whole)."""
    from flashtree.engine.runner import ModelRunner

    def timed(self, fn, repeats=2):  # every point a fixed time: the round 9 ms, its reset 1 ms
        fn()
        return {"round_": 0.009, "reset": 0.001}.get(fn.__name__, 0.002)

    rounds = []
    run_round = ModelRunner.run_round

    def recorded(self, reqs, plan, real):
        speculative = all(r.speculative for r in reqs) == bool(plan.drafting)
        rounds.append((len(reqs), plan.drafting > 0, plan.budget, speculative))
        return run_round(self, reqs, plan, real)

    monkeypatch.setattr(cost_model.Timer, "__call__", timed)
    monkeypatch.setattr(ModelRunner, "run_round", recorded)
    target, drafter = pair
    eng = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64,
                                 max_budget=16, max_batch=4, cost_cache="off"))
    cost, depth = eng.runner.policy.cost, eng.runner.block_size - 1
    plans = {(n, d, b) for n in (1, 2, 4) for d, b in ((False, 0), (True, 0), (True, 16))}
    assert {(n, d, b) for n, d, b, ok in rounds if ok} == plans and all(ok for *_, ok in rounds)
    for rows in (1, 2, 4):
        ar = float(cost.verify(rows, 1))
        chain = float(cost.verify(rows, depth + 1)) + float(cost.draft(rows, depth))
        tree = float(cost.verify(rows, 17)) + float(cost.draft(rows, depth)) + float(cost.tree(rows, 16))
        for column, staged in enumerate((ar, chain, tree)):
            assert np.isclose(float(cost.overhead(rows, column)), 0.008 - staged)
        assert np.isclose(cost.round_seconds(rows, depth + 1, rows, depth, 0, 0), 0.008)
        assert np.isclose(cost.round_seconds(rows, 17, rows, depth, rows, 16), 0.008)
    assert eng.runner.cache.lengths == [0] * 4 and eng.runner.draft_cache.lengths == [0] * 4

    def fast(self, fn, repeats=2):  # rounds quicker than their stage tables
        fn()
        return {"round_": 0.0015, "reset": 0.001}.get(fn.__name__, 0.002)

    monkeypatch.setattr(cost_model.Timer, "__call__", fast)
    quick = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64,
                                   max_budget=16, max_batch=4, cost_cache="off"))
    assert np.all(quick.runner.policy.cost.overhead.values == 0.0)


def test_startup_times_only_the_work_it_names(pair, monkeypatch):
    """No timed function draws its own inputs: the chain build's timing once drew its random logits
    inside the timed call, 10x the build on the demo pair, and every tree was floored at it."""
    target, drafter = pair
    draws = {"timed": 0, "inside": False}
    randn = torch.randn

    def counted(*args, **kwargs):
        draws["timed"] += draws["inside"]
        return randn(*args, **kwargs)

    timer_call = cost_model.Timer.__call__

    def timed(self, fn, repeats=2):
        draws["inside"] = True
        try:
            return timer_call(self, fn, repeats)
        finally:
            draws["inside"] = False

    monkeypatch.setattr(torch, "randn", counted)
    monkeypatch.setattr(cost_model.Timer, "__call__", timed)
    LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64, max_budget=16,
                           cost_cache="off"))
    assert draws["timed"] == 0


def test_startup_times_the_runners_own_drafter_pass_and_build(pair, monkeypatch):
    """What the cost model times as a drafter pass and a tree build is the runner's own work (a
    private copy left DFlash2's selector out, and drafting rounds ran 2-2.5x their prediction)."""
    from flashtree.engine.runner import ModelRunner

    calls = {"draft_pass": 0, "build": 0}
    for name in calls:
        original = getattr(ModelRunner, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(ModelRunner, name, staticmethod(counted) if name == "build" else counted)
    target, drafter = pair
    LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64, max_budget=16,
                           cost_cache="off"))
    assert calls["draft_pass"] >= 2 and calls["build"] >= 2


def test_keys_past_the_tables_context_are_priced_per_row_node_and_drafting_row():
    """The tables hold rows CONTEXT keys deep; a round over deeper rows costs its measured seconds
    per key for each verify row and node and each drafting row, the policy prices plans with it,
    and a round that took exactly its deeper prediction leaves the tables as they were."""
    cost = synthetic_cost(1e-4)
    cost.keys = (2e-7, 1e-7, 5e-7)
    deep = cost_model.CONTEXT + 500
    for rows, window, drafting in ((1, 1, 0), (4, 16, 2), (8, 9, 8)):
        extra = (2e-7 + 1e-7 * window) * rows * 500 + 5e-7 * drafting * 500
        base = cost.round_seconds(rows, window, drafting, 15, 0, 0)
        assert cost.round_seconds(rows, window, drafting, 15, 0, 0, keys=deep) == pytest.approx(base + extra)
    policy = Policy(cost, 16, 16, 64, 4096)
    ar, table = policy.seconds(4, deep)
    assert ar == pytest.approx(cost.round_seconds(4, 1, 0, 0, 0, 0, keys=deep))
    chain = policy.arm_plan(policy.chain_arm, 4)
    assert table[policy.chain_arm, 3] == pytest.approx(cost.round_seconds(4, chain.window, 3, chain.depth, 0, 0,
                                                                           keys=deep))
    before = cost.verify.values.copy(), cost.draft.values.copy()
    stages = {"verify": float(cost.verify(4, 16)) + sum(cost.extra(4, 16, 0, deep)),
              "draft_pass": float(cost.draft(4, 15)) + cost.extra(4, 16, 4, deep)[1], "tree": 0.0}
    cost.refine(4, 16, 4, 15, 0, 0, stages, stages["verify"] + stages["draft_pass"], keys=deep)
    assert np.allclose(cost.verify.values, before[0]) and np.allclose(cost.draft.values, before[1])


def test_sampled_rows_pay_their_noise_per_node_and_position(pair):
    """The tables time a greedy verify; a sampled row adds the seeded noise over the vocabulary at
    each node and position (on the CPU several times the argmax). Startup measures it, plans price it, a round
    that took its sampled prediction leaves the tables alone, and where the noise costs more than
    the chain saves, a sampled batch takes AR steps while a greedy one drafts."""
    target, drafter = pair
    engine = LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", max_model_len=64,
                                    max_budget=16, cost_cache="off"))
    assert all(c >= 0 for c in engine.runner.policy.cost.sample) and sum(engine.runner.policy.cost.sample) > 0
    cost = synthetic_cost(1e-4, draft=1e-3)
    cost.sample = (1e-4, 2e-4, 1e-3)
    policy = Policy(cost, 16, 16, 64, 4096)
    ar0, table0 = policy.seconds(4)
    ar, table = policy.seconds(4, sampled=3)
    assert ar == pytest.approx(ar0 + 3 * 1e-4)
    chain = policy.arm_plan(policy.chain_arm, 4)
    assert table[policy.chain_arm, 2] == pytest.approx(table0[policy.chain_arm, 2] + 3 * (1e-4 + 15 * 2e-4 + 15 * 1e-3))
    assert cost.round_seconds(4, chain.window, 2, chain.depth, 0, 0, sampled=3) == pytest.approx(
        table[policy.chain_arm, 2])
    before = cost.verify.values.copy()
    stages = {"verify": float(cost.verify(4, 16)) + cost.extra(4, 16, 0, sampled=3, positions=16)[2],
              "draft_pass": float(cost.draft(4, 15)), "tree": 0.0}
    cost.refine(4, 16, 4, 15, 0, 0, stages, stages["verify"] + stages["draft_pass"], sampled=3)
    assert np.allclose(cost.verify.values, before)
    greedy = _run(Policy(cost, 16, 16, 64, 4096), _requests(4), accept=0.9, rounds=3)
    sampled = _run(Policy(cost, 16, 16, 64, 4096), _requests(4, temperature=1.0), accept=0.9, rounds=3)
    assert greedy[0].modes == [CHAIN] * 4 and all(p.modes == [AR] * 4 for p in sampled)


def test_tree_costs_follow_their_measured_points():
    """The tree table is the tree builds' own timings (interpolated)."""
    v = {(r, n): 1e-3 * r * n for r in (1, 4) for n in (1, 2, 3, 5)}
    tr = {(1, 4): 1e-4, (1, 16): 2e-4, (4, 4): 3e-4, (4, 16): 6e-4}
    model = cost_model._tables(v, {1: 1e-3, 4: 2e-3}, {1: 1e-4, 4: 4e-4}, tr, 4, [1, 2, 3, 5], [4, 16], 4, 5, 16, 0.0)
    for (r, b), s in tr.items():
        assert float(model.tree(r, b)) == pytest.approx(s)


def test_cost_cache_location(monkeypatch, tmp_path):
    """$FLASHTREE_CACHE_DIR wins, then $XDG_CACHE_HOME/flashtree, then ~/.cache/flashtree; "off" disables."""
    monkeypatch.setenv("FLASHTREE_CACHE_DIR", str(tmp_path / "a"))
    assert cost_cache.cache_dir(None) == tmp_path / "a"
    monkeypatch.delenv("FLASHTREE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cost_cache.cache_dir(None) == tmp_path / "x" / "flashtree"
    assert cost_cache.cache_dir(str(tmp_path / "b")) == tmp_path / "b"
    assert cost_cache.cache_dir("off") is None


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
