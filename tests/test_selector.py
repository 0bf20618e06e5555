"""The selector's measurement (tree/value.py accepted_by_size, spine_run; the engine reads the same
from the path's codes, runner.path_codes and selector.by_size): one verified tree gives exactly
what every smaller exact tree, and the chain, would have accepted. And the selector's
choices (engine/selector.py) on synthetic acceptance and costs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashtree.engine import selector
from flashtree.engine.runner import path_codes
from flashtree.engine.selector import (AR_ARM, CHAIN_ARM, COLD_ROUNDS, KEEP_MAX, KEEP_MIN, SETTLE, SETTLE_FLOOR,
                                       SHAPE_PRIOR, STAY, Selector, by_size, settled)
from flashtree.tree import accept_walk, build_chain, build_tree
from flashtree.tree.markov import build_markov_chain, build_markov_tree
from flashtree.tree.value import accepted_by_size, spine_mask, spine_run


def _picks(spec, table: torch.Tensor) -> torch.Tensor:
    """A target whose pick at a node depends only on the node's depth and token (so on its prefix):
    the same node gets the same pick in any tree that holds it."""
    R = spec.tokens.shape[0]
    depth = spec.depths.expand_as(spec.tokens)
    rows = torch.arange(R)[:, None].expand_as(spec.tokens)
    return table[rows, depth, spec.tokens.clamp(min=0)]


def _table(draft_best: torch.Tensor, V: int, g: torch.Generator) -> torch.Tensor:
    """[R, D+1, V]: mostly the drafter's best token at the next depth, else its second, else random."""
    R, D, _ = draft_best.shape
    u = torch.rand(R, D + 1, V, generator=g)
    nxt = torch.cat([draft_best, draft_best[:, -1:]], 1)  # depth d's pick drafts depth d+1's token
    rand = torch.randint(0, V, (R, D + 1, V), generator=g)
    return torch.where(u < 0.6, nxt[..., :1], torch.where(u < 0.85, nxt[..., 1:2], rand))


@pytest.mark.parametrize("markov", [False, True])
def test_one_tree_measures_every_smaller_tree_and_the_chain(markov):
    g = torch.Generator().manual_seed(3)
    R, D, V, K, B = 6, 7, 12, 4, 40
    roots = torch.randint(0, V, (R,), generator=g)
    if markov:
        cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(R * D)]).view(R, D, K)
        trans = torch.log_softmax(2 * torch.randn(R, D, K, K, generator=g), -1)
        build = lambda b: build_markov_tree(roots, cand, trans, b)  # noqa: E731
        chain = build_markov_chain(roots, cand, trans)
        best = cand[..., :2]
    else:
        logits = 3 * torch.randn(R, D, V, generator=g)
        build = lambda b: build_tree(roots, logits, b)  # noqa: E731
        chain = build_chain(roots, logits)
        best = logits.topk(2, -1).indices
    table = _table(best, V, g)
    big = build(B)
    measured = accepted_by_size(big, accept_walk(big, _picks(big, table)).path)
    for b in range(1, B + 1):
        small = build(b)
        walked = accept_walk(small, _picks(small, table)).num_nodes - 1
        assert torch.equal(measured[:, b - 1].long(), walked), b
    path = accept_walk(big, _picks(big, table)).path
    run = spine_run(big, path)
    length = (spine_mask(big) & (big.tokens >= 0))[:, 1:].sum(1)
    chained = accept_walk(chain, _picks(chain, table)).num_nodes - 1
    whole = (run < length) | (length == D)  # the run did not reach the end of a short spine
    assert torch.equal(run[whole], chained[whole]) and bool((run <= chained).all())
    assert whole.any()
    # What the engine reads instead: the path's codes, decoded on the host, give the same, and
    # flag the runs that reached the end of the tree's spine (the chain's walk went on unseen).
    codes = path_codes(big, path).tolist()
    for r in range(R):
        by, spine, open_ = by_size(codes[r], list(range(1, B + 1)))
        assert by == measured[r].long().tolist() and spine == int(run[r]), r
        assert open_ == bool(run[r] == length[r]), r


def _play(sel: Selector, rounds: int, acc_tree, acc_chain: float, seconds: dict, rows: int = 1) -> list[int]:
    """Rounds where a tree of column j accepts acc_tree[j] per row and the chain acc_chain; the
    arm comes as Policy._select takes it (decided ahead, or chosen)."""
    arms = []
    for _ in range(rounds):
        arm = sel.kept(0, rows)
        if arm is None:
            arm = sel.choose(0, rows, seconds, seconds[AR_ARM])
        arms.append(arm)
        if arm == CHAIN_ARM:
            sel.observe(0, rows, None, np.full(rows, acc_chain))
        elif arm >= 0:
            tree = np.tile(np.asarray(acc_tree[: arm + 1], dtype=float), (rows, 1))
            spine = min(int(sel.grid[arm]), sel.depth)  # the tree's spine: as deep as it has nodes
            chain = [(min(acc_chain, spine), acc_chain < spine or spine == sel.depth)] * rows
            sel.observe(0, rows, tree, np.full(rows, min(acc_chain, acc_tree[arm])), chain=chain)
        else:
            sel.idle(0)
    return arms


GRID = np.array([1, 2, 4, 8, 15, 16, 32])


def _seconds(per_node: float, ar: float = 1.0) -> dict:
    out = {AR_ARM: ar, CHAIN_ARM: 1.2 + 15 * per_node}
    out.update({j: 1.2 + b * per_node for j, b in enumerate(GRID)})
    return out


def test_selector_opens_big_then_plays_the_best_measured_arm():
    """A new class opens with the biggest tree that costs at most twice the cheapest drafting
    round, then plays the arm of best measured rate: here the tree of 8 (its acceptance flattens
    past 8, and bigger trees cost more), exploring only a small share of rounds."""
    sel = Selector(GRID, 15)
    acc = [0.9, 1.7, 3.0, 5.0, 5.3, 5.3, 5.4]
    arms = _play(sel, 200, acc, acc_chain=4.0, seconds=_seconds(0.05))
    assert arms[:COLD_ROUNDS] == [5] * COLD_ROUNDS  # 1.2 + 16 * 0.05 <= 2 * (1.2 + 0.05) < 1.2 + 32 * 0.05
    assert arms[20:].count(3) > 0.8 * 180


def test_selector_prefers_the_chain_when_it_accepts_more():
    sel = Selector(GRID, 15)
    arms = _play(sel, 200, [0.9, 1.7, 2.5, 3.0, 3.2, 3.2, 3.3], acc_chain=6.0, seconds=_seconds(0.01))
    assert arms[20:].count(CHAIN_ARM) > 0.8 * 180


def test_selector_stays_on_ar_where_drafting_loses_and_rechecks_stale_arms():
    """Drafting loses (AR steps win, 1.5x) at 16 rows: AR in nine rounds of ten or more (the
    probes come rarer as the evidence grows). A tree whose
    estimate went stale is re-measured now and then, and when it has become good it is played."""
    sel = Selector(GRID, 15)
    weak = [0.1, 0.2, 0.3, 0.4, 0.4, 0.4, 0.4]
    seconds = {a: 16 * s for a, s in _seconds(0.05).items()}
    seconds[AR_ARM] = 12.0
    arms = _play(sel, 400, weak, 0.3, seconds, rows=16)
    assert arms[20:].count(AR_ARM) > 0.9 * 380
    good = [0.9, 1.9, 3.9, 7.9, 14, 14, 14]
    arms = _play(sel, 600, good, 14.0, seconds, rows=16)
    assert AR_ARM not in arms[-100:]


def test_selector_keeps_ar_steps_within_the_margin_and_drafts_beyond_it():
    """Near parity AR steps win: a tree predicting 2% more tokens per second than AR is not
    played over them (only probed), one predicting 10% more is. Rates at 16 rows: AR 16/12;
    the tree of 4 16 * (1 + acc) / 13.6 s."""
    seconds = {a: 16 * s for a, s in _seconds(0.05).items()}
    seconds[AR_ARM] = 12.0
    for gain, drafts in ((1.02, False), (1.10, True)):
        acc = gain * seconds[2] / seconds[AR_ARM] - 1.0  # the tree of 4's rate, gain x AR's
        sel = Selector(GRID, 15)
        arms = _play(sel, 300, [0.0, 0.0, acc, acc, acc, acc, acc], acc, seconds, rows=16)
        assert (arms[50:].count(AR_ARM) > 0.9 * 250) != drafts, gain
        assert (arms[50:].count(2) > 0.8 * 250) == drafts, gain


def test_arm_times_take_the_median_and_scale_untimed_arms_by_the_nearest_window():
    """Timed arms cost their rounds' median (an outlier round does not move it); an arm not timed
    yet takes the model's seconds scaled like the timed drafting arm of the nearest window, and a
    batch size with no drafting arm timed borrows the nearest timed size's scales."""
    from flashtree.engine.selector import ArmTimes

    times = ArmTimes(lambda arm: {AR_ARM: 1, CHAIN_ARM: 16, 0: 5, 1: 9, 2: 33}[arm])
    modelled = {AR_ARM: 1.0, CHAIN_ARM: 4.0, 0: 2.0, 1: 3.0, 2: 6.0}
    assert times.seconds(4, modelled) == modelled  # nothing timed: the model
    for s in (5.0, 5.2, 50.0, 5.1):  # one round also flushed held-back context
        times.record(4, CHAIN_ARM, s, modelled[CHAIN_ARM])
    for s in (2.0, 2.0):
        times.record(4, 0, s, modelled[0])  # only two rounds: not yet the arm's price
    out = times.seconds(4, modelled)
    assert out[CHAIN_ARM] == pytest.approx(5.15)
    assert out[2] == pytest.approx(6.0 * 5.15 / 4.0) and out[1] == pytest.approx(3.0 * 5.15 / 4.0)
    assert out[AR_ARM] == pytest.approx(1.0 * 5.15 / 4.0)  # untimed AR too: the machine's load is shared
    assert times.counts(4, modelled)[0] == 2
    assert times.seconds(8, modelled) == pytest.approx(out)  # a size never timed: the nearest timed one's


def test_arm_times_price_an_arm_timed_in_a_slow_stretch_at_the_current_speed():
    """The machine slows by half for a stretch (another job), and the tree of 4 is only played
    then; once the speed is back, it is priced at the speed the chain's rounds now show, not at
    its own rounds' seconds (1.5x). The chain runs 1.2x the model's seconds, the tree 1.0x."""
    from flashtree.engine.selector import ArmTimes

    times = ArmTimes(lambda arm: {AR_ARM: 1, CHAIN_ARM: 16, 0: 5}[arm])
    modelled = {AR_ARM: 1.0, CHAIN_ARM: 4.0, 0: 2.0}
    true = {CHAIN_ARM: 4.8, 0: 2.0}

    def play(arm, speed):
        times.seconds(4, modelled)  # as each planned round does
        times.record(4, arm, true[arm] * speed, modelled[arm])

    for _ in range(10):
        play(CHAIN_ARM, 1.0)
    for _ in range(30):
        play(CHAIN_ARM, 1.5)
    for _ in range(10):
        play(CHAIN_ARM, 1.5)
        play(0, 1.5)
    for _ in range(40):
        play(CHAIN_ARM, 1.0)
    out = times.seconds(4, modelled)
    assert out[CHAIN_ARM] == pytest.approx(4.8, rel=0.03)
    assert out[0] == pytest.approx(2.0, rel=0.05)


def test_lead_judges_a_seat_at_the_long_run_level_not_a_cold_stretch():
    """Policy.admit seats a request plain for its whole life when AR steps lead (Selector.lead).
    After 400 rounds where drafting wins by far, a stretch of 20 cold rounds drops the recent
    level so that AR steps lead on it, yet the lead stays well below parity: the stretch does not
    seat requests plain for good."""
    sel = Selector(GRID, 15)
    seconds = {a: 4 * s for a, s in _seconds(0.05).items()}
    seconds[AR_ARM] = 2.0
    good = [0.9, 1.7, 3.0, 5.0, 5.3, 5.3, 5.4]
    _play(sel, 400, good, 6.0, seconds, rows=4)
    for _ in range(20):
        sel.observe(0, 4, np.tile(np.full(len(GRID), 0.1), (4, 1)), np.full(4, 0.1))
    rates = sel.rates(0, 4, seconds, seconds[AR_ARM])
    recent = rates[AR_ARM] / max(r for a, r in rates.items() if a != AR_ARM)
    assert recent > 1.2  # on the recent level alone, AR steps would settle the class
    assert sel.lead(0, 4, seconds, seconds[AR_ARM]) < 0.8


def test_the_chain_is_measured_in_tree_rounds_past_their_short_spines():
    """Every drafting round measures the chain: a tree round's run along its spine is the chain's
    own, or a lower bound where it reached the end of a short spine. Here the chain goes on past
    each depth with chance 0.8 (3.86 tokens of 15 on average) and the trees' spines end after 2
    to 15 nodes; never playing the chain, the estimate comes out at its mean, where the runs
    themselves average 3.1. Rows cut at their request's end count as cut: 3 tokens, then 3."""
    sel = Selector(GRID, 15)
    sel.shape_rate = 0.001  # slow sums over ~1000 rows: the estimate's noise well under the gap
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(600):
        chain, run = [], []
        for _ in range(4):
            x = min(int(rng.geometric(0.2)) - 1, 15)  # tokens the chain accepts
            spine = int(rng.integers(2, 16))
            run.append(min(x, spine))
            chain.append((run[-1], x < spine))
        runs += run
        sel.observe(0, 4, np.zeros((4, 4)), np.array(run, dtype=float), chain=chain)
    truth = sum(0.8**d for d in range(1, 16))
    assert sel.chain_tokens(sel.stats[0]) == pytest.approx(truth, rel=0.06)
    assert np.mean(runs) < 0.85 * truth
    for _ in range(600):  # then every row is cut at 3 kept tokens (exact, whatever the spine)
        sel.observe(0, 4, np.zeros((4, 4)), np.full(4, 3.0), chain=[(3, True)] * 4)
    assert sel.chain_tokens(sel.stats[0]) == pytest.approx(3.0, abs=0.1)


def test_a_steady_class_is_predicted_what_its_arms_accepted():
    """At a steady level the estimates give back what each arm's rounds accepted: the trees' per
    size, the chain's, and a tree of one node at most one token. (With the pseudo-count on one
    side of the increments, the tree of 8 here came out 4.2 for 4.4 accepted.)"""
    sel = Selector(GRID, 15)
    acc = [0.95, 1.7, 3.0, 4.4, 6.0, 6.0, 6.1]  # the tree of 15, the chain's size, as the chain
    for _ in range(60):  # the trees' spines run as far as the chain (and their base is 3)
        sel.observe(0, 4, np.tile(np.asarray(acc), (4, 1)), np.full(4, 6.0))
        sel.observe(0, 4, None, np.full(4, 6.0))
    tree, chain = sel.accepted(0)
    assert tree == pytest.approx(acc) and chain == pytest.approx(6.0)
    for _ in range(60):  # trees measured at a low base, then the level climbs
        sel.observe(0, 4, np.tile(np.asarray(acc), (4, 1)), np.full(4, 1.0))
    for _ in range(20):
        sel.observe(0, 4, None, np.full(4, 15.0))
    assert sel.accepted(0)[0][0] == pytest.approx(1.0)  # the tree of one node: one token at most


def test_a_tree_measured_in_a_bigger_trees_rounds_is_predicted_its_own_rounds_tokens():
    """Rounds start where the played arm put them. Here half the tree of 8's rounds start in easy
    text (it accepts 7 tokens, the tree of 2 accepts 2) and half in hard text (both accept 0), so
    its rounds cover 8 easy tokens per hard one. Played there, the tree of 2 needs 3 rounds for
    every 3 easy tokens: over its own rounds, by tokens covered, it accepts
    1 / ((8/9)/3 + (1/9)/1) - 1 = 1.45 tokens, not the 1.0 it averaged in the tree of 8's rounds."""
    grid = np.array([2, 8])
    sel = Selector(grid, 8)
    easy = np.array([[2.0, 7.0]] * 2)
    hard = np.zeros((2, 2))
    for _ in range(150):
        sel.observe(0, 2, easy, np.full(2, 7.0))
        sel.observe(0, 2, hard, np.zeros(2))
    tree, _ = sel.accepted(0)
    assert tree[0] == pytest.approx(1 / ((8 / 9) / 3 + (1 / 9)) - 1, rel=0.05)
    assert tree[1] == pytest.approx(3.5, rel=0.05)  # the played tree: its own average
    rows = np.array([[2.0, 7.0], [0.0, 0.0]])  # easy and hard rows in one round weigh alike
    sel = Selector(grid, 8)
    for _ in range(150):
        sel.observe(0, 2, rows, np.array([7.0, 0.0]))
    assert sel.accepted(0)[0][0] == pytest.approx(1 / ((8 / 9) / 3 + (1 / 9)) - 1, rel=0.05)


def test_a_trees_own_steady_rounds_correct_what_other_arms_rounds_measured():
    """A round's acceptance depends on where it starts, and the arm played puts the starts. Here
    the tree of 16's rounds measure the tree of 8 at 6 tokens, while the tree of 8's own rounds,
    in stretches of three between the tree of 16's, keep 4. The tree of 8's estimate follows its
    steady rounds (the second and third of a stretch, which start where one of its rounds
    ended); rounds after another arm's teach nothing of it (steady False: the estimate stays
    near what all rounds measured), and the record fades back once it is no longer played."""
    big, own = [1.0, 2.0, 3.5, 6.0, 8.0, 8.0], [1.0, 2.0, 3.5, 4.0]
    ests, sels = {}, {}
    for steady in (True, False):
        sel = sels[steady] = Selector(GRID, 15)
        for _ in range(40):
            for i in range(3):
                sel._estimate(0)
                sel.observe(0, 4, np.tile(np.asarray(big), (4, 1)), np.full(4, 8.0), steady=[i > 0] * 4)
            for i in range(3):
                sel._estimate(0)
                sel.observe(0, 4, np.tile(np.asarray(own), (4, 1)), np.full(4, 4.0), steady=[steady and i > 0] * 4)
        ests[steady] = (sel._estimate(0)[0][3], sel.stats[0].raw_estimate[0][3])
    (fixed, raw), (plain, plain_raw) = ests[True], ests[False]
    assert raw > 4.5 and fixed == pytest.approx(4.0, rel=0.1)
    assert plain == pytest.approx(plain_raw, rel=0.03) and plain > 4.5
    sel = sels[True]
    for _ in range(600):  # the tree of 16 alone: the tree of 8's record fades back
        sel._estimate(0)
        sel.observe(0, 4, np.tile(np.asarray(big), (4, 1)), np.full(4, 8.0), steady=[True] * 4)
    assert sel.own_fix(sel.stats[0])[3] == pytest.approx(1.0, abs=0.1)


def test_the_chain_keeps_no_record_its_own_rounds_go_into_its_estimate():
    """The chain's own rounds are measured exactly and go into its estimate as they come, so it
    takes no own-rounds factor: where the trees' spines measure it at 8 and its own steady
    rounds keep 4, its estimate lies between (each round's rows weigh alike), its factor is 1."""
    acc = [1.0, 2.0, 3.5, 6.0, 8.0, 8.0]
    sel = Selector(GRID, 15)
    for _ in range(40):
        for i in range(3):
            sel._estimate(0)
            sel.observe(0, 4, np.tile(np.asarray(acc), (4, 1)), np.full(4, 8.0), chain=[(8, True)] * 4,
                        steady=[i > 0] * 4)
        for i in range(3):
            sel._estimate(0)
            sel.observe(0, 4, None, np.full(4, 4.0), steady=[i > 0] * 4)
    assert sel.own_fix(sel.stats[0])[-1] == 1.0
    assert 4.5 < sel._estimate(0)[1] < 7.5


def test_a_few_lucky_chain_rows_do_not_lift_the_chain_over_a_measured_tree():
    """The chain is measured in every tree round too (their runs along the spine): one row of 15
    tokens and two of 8.5 of its own do not make it the best arm where 40 tree rounds of four
    rows measured what it accepts on average. And each row weighs alike: a round of one row
    counts a quarter of a round of four."""
    sel = Selector(GRID, 15)
    acc = [0.95, 1.7, 3.0, 4.4, 5.6, 5.6, 6.0]  # the tree of 15 (the chain's twin) accepts 5.6
    for _ in range(40):
        sel.observe(0, 4, np.tile(np.asarray(acc), (4, 1)), np.full(4, 3.0))
    sel.observe(0, 2, None, np.full(2, 8.5))
    sel.observe(0, 1, None, np.full(1, 15.0))
    _, chain = sel.accepted(0)
    assert chain < 6.5  # (with four rounds of prior, and a round as one sample: 7.2)
    assert sel.stats[0].weight[len(GRID)] == 3


def test_a_seat_is_not_settled_on_ar_steps_from_a_few_rounds():
    """Policy.admit seats a request plain for life when AR steps lead (Selector.lead). After the
    three opening rounds AR steps predicting 1.2x the best drafting arm do not settle it (the
    estimates are hopeful while they rest on few rows); after a hundred rounds, AR leading by
    far does, the hope down to 5% (the class's 412 drafted rows: by the rounds it would still be
    14%)."""
    seconds = {a: 4 * s for a, s in _seconds(0.05).items()}
    seconds[AR_ARM] = 2.6
    sel = Selector(GRID, 15)
    acc = [0.3, 0.5, 0.8, 1.0, 1.2, 1.2, 1.3]
    for _ in range(COLD_ROUNDS):
        sel.observe(0, 4, np.tile(np.asarray(acc), (4, 1)), np.full(4, 1.0))
    rates = sel.rates(0, 4, seconds, seconds[AR_ARM])
    assert rates[AR_ARM] / max(r for a, r in rates.items() if a != AR_ARM) > 1.19
    assert sel.lead(0, 4, seconds, seconds[AR_ARM]) < 1.0
    weak = [0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.3]
    for i in range(100):  # tree and chain rounds in turn: 212 and 200 rows behind their arms
        sel.observe(0, 4, None if i % 2 else np.tile(np.asarray(weak), (4, 1)), np.full(4, 0.3))
    assert sel.lead(0, 4, seconds, seconds[AR_ARM]) > 1.3
    st = sel.stats[0]
    scale = (st.long_level + SHAPE_PRIOR) / (st.level + SHAPE_PRIOR)  # the long-run level, as lead
    rates = sel.rates(0, 4, seconds, seconds[AR_ARM], scale=scale)
    bare = rates[AR_ARM] / max(r for a, r in rates.items() if a != AR_ARM)
    # a hope of 1 / sqrt(1 + rows), 5%, where by the rounds (103) it would be 10%
    assert bare / 1.08 < sel.lead(0, 4, seconds, seconds[AR_ARM]) < bare


def test_arms_never_played_since_the_opening_do_not_keep_a_seat_hopeful():
    """At one row a round, the opening measures every tree up to 32 in three rows; the probes
    after it play the tree of 4, which measures only the trees up to it, and the chain is never
    played. AR steps run 1.4x the best drafting arm, and after 200 drafted rows they settle the
    class: the lead's hope counts the class's rows, not each arm's (by the arm's, the chain's
    hope of 2 kept the lead at 0.85 and every request was seated speculative)."""
    sel = Selector(GRID, 15)
    acc = [0.5, 0.8, 1.0, 1.2, 1.3, 1.3, 1.4]
    for _ in range(COLD_ROUNDS):
        sel.observe(0, 1, np.asarray([acc]), np.full(1, 1.0))
    for _ in range(200):
        sel.observe(0, 1, np.asarray([acc[:3]]), np.full(1, 1.0))
    seconds = _seconds(0.05, ar=0.5)
    rates = sel.rates(0, 1, seconds, seconds[AR_ARM])
    bare = rates[AR_ARM] / max(r for a, r in rates.items() if a != AR_ARM)
    assert bare == pytest.approx(1.4)
    assert sel.stats[0].weight[len(GRID)] == 0  # the chain: no rows of its own
    assert bare / 1.08 < sel.lead(0, 1, seconds, seconds[AR_ARM]) < bare


def test_drafting_arms_that_tie_play_the_cheapest():
    """Trees of 8 and 16 predicted within 1% of each other (the bigger accepting what its extra
    cost buys): the tree of 8 is played, not the one a hair ahead."""
    seconds = _seconds(0.05)
    acc8 = 4.0
    rate8 = (1 + acc8) / seconds[3]
    acc16 = 1.01 * rate8 * seconds[5] - 1  # the tree of 16's rate: 1.01 x the tree of 8's
    acc = [0.9, 1.7, 3.0, acc8, acc16 - 0.2, acc16, acc16 + 0.1]
    sel = Selector(GRID, 15)
    arms = _play(sel, 200, acc, acc_chain=3.0, seconds=seconds)
    assert arms[50:].count(3) > 0.8 * 150


def test_the_arm_chosen_stays_until_another_leads_by_the_stay_margin():
    """The tree of 8 leads the chain; then the chain creeps 2% ahead (within STAY, where the
    estimates' noise and a switch's cost decide): the tree of 8 stays. At 8% ahead the chain
    takes over. (Without the margin the chain took 83% of the middle stretch.)"""
    seconds = _seconds(0.05)
    acc8 = 4.0
    rate8 = (1 + acc8) / seconds[3]
    acc = [0.9, 1.7, 3.0, acc8, 4.2, 4.3, 4.4]  # bigger trees add little for their cost

    def chain_at(lead: float) -> float:
        return lead * rate8 * seconds[CHAIN_ARM] - 1

    counts = {}
    for stay in (STAY, 1.0):
        sel = Selector(GRID, 15)
        sel.stay = stay
        _play(sel, 150, acc, acc_chain=chain_at(0.9), seconds=seconds)
        middle = _play(sel, 300, acc, acc_chain=chain_at(1.02), seconds=seconds)[100:]
        last = _play(sel, 300, acc, acc_chain=chain_at(1.08), seconds=seconds)[150:]
        counts[stay] = (middle.count(3) / len(middle), last.count(CHAIN_ARM) / len(last))
    assert counts[STAY][0] > 0.8 and counts[STAY][1] > 0.8
    assert counts[1.0][0] < 0.5


def test_arm_times_price_a_tree_from_trees_and_lean_on_the_pooled_trees():
    """An untimed tree takes a timed tree's bias before the chain's, even where the chain's
    window is nearer (the chain builds no tree: its model error is its own). A tree with three
    slow rounds (1.5x the model) leans on the trees' pooled rounds (1.0x) until its own add up."""
    from flashtree.engine.selector import TREE_PRIOR, ArmTimes

    times = ArmTimes(lambda arm: {AR_ARM: 1, CHAIN_ARM: 16, 0: 5, 1: 9, 2: 33}[arm])
    modelled = {AR_ARM: 1.0, CHAIN_ARM: 4.0, 0: 2.0, 1: 3.0, 2: 6.0}
    for _ in range(5):
        times.record(4, AR_ARM, 1.0, 1.0)
        times.record(4, CHAIN_ARM, 6.0, 4.0)  # the chain: 1.5x its model
        times.record(4, 2, 6.0, 6.0)  # the tree of 32: as modelled
    out = times.seconds(4, modelled)
    assert out[1] == pytest.approx(3.0)  # from the tree of 32, not the chain's 1.5
    for _ in range(3):
        times.record(4, 0, 3.0, 2.0)  # the tree of 4: three rounds at 1.5x
    out = times.seconds(4, modelled)
    pooled = (5 * 1.0 + 3 * 1.5) / 8  # every tree round's ratio: the median lies between
    assert 2.0 < out[0] < 2.0 * (3 * 1.5 + TREE_PRIOR * 1.0) / (3 + TREE_PRIOR) + 1e-9
    assert pooled < 1.5


def _count_kept(sel: Selector) -> list[bool]:
    """Per round from now: whether its arm was decided ahead (Selector.kept)."""
    flags: list[bool] = []
    kept = sel.kept
    sel.kept = lambda *a: _record(flags, kept(*a))
    return flags


def _record(flags: list[bool], arm):
    flags.append(arm is not None)
    return arm


def test_a_clear_lead_is_decided_further_ahead_than_a_near_tie():
    """The chain leading every other arm by far: most rounds take the arm decided ahead (no
    choice computed), never more than KEEP_MAX in a row, and the exploration credit still
    accrues in them (the stale trees are re-measured). Two arms within 1%: a choice holds for
    KEEP_MIN rounds only (near a tie it costs little either way)."""
    seconds = _seconds(0.01)
    sel = Selector(GRID, 15)
    kept = _count_kept(sel)
    arms = _play(sel, 300, [0.9, 1.7, 2.5, 3.0, 3.2, 3.2, 3.3], acc_chain=6.0, seconds=seconds)
    assert sum(kept) > 0.5 * 300 and arms[50:].count(CHAIN_ARM) > 0.9 * 250
    assert any(a >= 0 for a in arms[50:])  # explored from kept rounds' credit
    run = longest = 0
    for k in kept:
        run = run + 1 if k else 0
        longest = max(longest, run)
    assert longest == KEEP_MAX
    # A kept round's prediction (the stats' and /metrics') is the estimate it was decided with,
    # not recomputed: that was most of a kept round's plan.
    computed = []
    accepted = sel.accepted
    sel.accepted = lambda cls: (computed.append(cls), accepted(cls))[1]
    for _ in range(40):
        decided = sel.kept(0, 1)
        if decided is not None:
            before = len(computed)
            assert sel.predicted(0, decided) == sel.stats[0].keep[4]
            assert len(computed) == before
        else:
            decided = sel.choose(0, 1, seconds, seconds[AR_ARM])
        if decided == CHAIN_ARM:
            sel.observe(0, 1, None, np.full(1, 6.0))
        else:
            sel.observe(0, 1, np.full((1, decided + 1), 3.0), np.full(1, 6.0))
    assert len(computed) < 40

    rate15 = (1 + 5.0) / seconds[4]
    chain = 1.005 * rate15 * seconds[CHAIN_ARM] - 1  # 0.5% ahead of the tree of 15
    sel = Selector(GRID, 15)
    kept = _count_kept(sel)
    _play(sel, 200, [0.9, 1.7, 2.5, 3.5, 5.0, 5.0, 5.1], acc_chain=chain, seconds=seconds)
    run = longest = 0
    for k in kept:
        run = run + 1 if k else 0
        longest = max(longest, run)
    assert longest == KEEP_MIN and sum(kept) > 0.3 * 200


def test_the_exploration_share_stays_settled_through_a_draining_batch():
    """A batch of 4 drains to 3 for two rounds after every 40 (a request ends before the next is
    seated), the chain best at both sizes: back at 4 rows the share is as settled as the rounds
    the chain has held there say, and the runners-up take few of the later rounds (3 of 400
    here; with one record for all sizes, each change of size started it over: 13, and at T = 0,
    c = 4 on the demo pair the share never settled)."""
    sel = Selector(GRID, 15)
    acc = [0.9, 1.7, 2.5, 3.0, 3.2, 3.2, 3.3]
    seconds = _seconds(0.01)
    late = 0
    for cycle in range(20):
        arms = _play(sel, 40, acc, acc_chain=6.0, seconds=seconds, rows=4)
        late += sum(a != CHAIN_ARM for a in arms) if cycle >= 10 else 0
        _play(sel, 2, acc, acc_chain=6.0, seconds=seconds, rows=3)
    assert late <= 6
    s = sel.stats[0]
    assert settled(s.clock - s.settle[4][1]) < 0.5


def test_the_exploration_share_settles_as_the_best_arm_holds(monkeypatch):
    """Full while the best arm is new, then as sqrt(SETTLE / rounds held), never below the floor;
    so where the chain leads for good, the runners-up take far fewer of the later rounds than
    with a share that never settles (10 against 28 of 800 here)."""
    assert settled(1) == settled(SETTLE) == 1.0
    assert settled(4 * SETTLE) == pytest.approx(0.5)
    assert settled(10 ** 6) == SETTLE_FLOOR
    acc = [0.9, 1.7, 2.5, 3.0, 3.2, 3.2, 3.3]
    explored = []
    for settles in (True, False):
        if not settles:
            monkeypatch.setattr(selector, "settled", lambda held: 1.0)
        arms = _play(Selector(GRID, 15), 1000, acc, acc_chain=6.0, seconds=_seconds(0.01))
        explored.append(sum(a != CHAIN_ARM for a in arms[200:]))
    assert 0 < explored[0] < 0.6 * explored[1]
