"""capture=True (compile=True on CUDA): a fixed method's rounds are captured at start-up and replayed through static
buffers (flashtree/engine/graphs.py). On the CPU the replay runs eagerly through the same buffers
and overwrites its declared outputs at every replay, as a CUDA graph would; these tests hold the
bookkeeping around it to the invariants: greedy output equals AR, a seeded request samples the
same tokens as uncaptured AR, hybrid targets included, and nothing compiles after start-up."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from flashtree import LLM, SamplingParams
from flashtree.models import compiled as compiled_module
from flashtree.engine.graphs import Piece
from flashtree.engine.round_plan import fixed_plan
from flashtree.engine.shapes import batch_bucket
from tests.test_qwen3_5 import make_qwen35
from tests.tiny import make_drafter, make_target

VOCAB = 16
PROMPTS = [[1, 2, 3], [4], list(range(1, 15)) * 2, [7, 7, 7, 7, 7, 7, 9], [5, 6] * 9]
METHODS = [("ar", 1), ("dflash", 1), ("ddtree", 4), ("ddtree", 32)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("captured")
    dense = make_target(root / "dense", vocab=VOCAB, logit_scale=3.0)
    hybrid, _ = make_qwen35(root / "hybrid", vocab_size=VOCAB, logit_scale=4.0)
    drafter = make_drafter(root / "drafter", target_layers=4, vocab=VOCAB, block_size=8)
    return {"dense": (str(dense), str(drafter)), "hybrid": (str(hybrid), str(drafter))}


def generate(pair, method, budget, params, captured, max_batch=3, prompts=PROMPTS):
    target, drafter = pair
    llm = LLM(target, None if method == "ar" else drafter, method=method, budget=budget, device="cpu",
              max_batch=max_batch, max_model_len=192, capture=captured)
    assert (llm.engine.runner.graphs is not None) == captured
    return llm.generate(prompts, params)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("method,budget", METHODS)
def test_captured_greedy_matches_ar(pairs, kind, method, budget):
    """Five prompts through three slots (batches of 1 to 3, padded to buckets of 1, 2 and 4 rows),
    replayed rounds: the tokens of uncaptured AR."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in generate(pairs[kind], "ar", 1, params, captured=False)]
    outs = generate(pairs[kind], method, budget, params, captured=True)
    assert [o.token_ids for o in outs] == ref
    if method != "ar":
        assert max(max(o.stats.accept_lengths) for o in outs) >= 2  # drafted nodes were kept: commit moved them


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("method,budget", METHODS[1:])
def test_captured_seeded_sampling_matches_ar(pairs, kind, method, budget):
    """Seeded top-k/top-p sampling: a replayed round's sampler reads the static logits, and every
    request gets the tokens uncaptured AR gives it."""
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=8, max_tokens=32, ignore_eos=True, seed=7)
    ref = [o.token_ids for o in generate(pairs[kind], "ar", 1, params, captured=False)]
    assert [o.token_ids for o in generate(pairs[kind], method, budget, params, captured=True)] == ref


@pytest.fixture(scope="module")
def compiled(pairs):
    """compile=True on the CPU: the dense target's stack and the drafter's layers compiled at
    start-up, for a fixed tree and for budget="auto" (whose cost tables then time the compiled
    forwards)."""
    target, drafter = pairs["dense"]
    engines = [LLM(target, drafter, method="ddtree", budget=b, device="cpu", max_batch=4, max_model_len=192,
                   compile=True) for b in (16, "auto")]
    assert all(llm.engine.runner.target.compiled and llm.engine.runner.drafter.compiled for llm in engines)
    return engines


@pytest.mark.slow
def test_nothing_compiles_after_start_up(pairs, compiled):
    """Once the engines are built, prompts of several lengths and batches of 1..max_batch trigger
    no dynamo compilation, and give uncompiled AR's tokens."""
    before = counters["stats"]["unique_graphs"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for n in range(1, 5):
        prompts = [[3] * (1 + 13 * i) for i in range(n)]
        ref = [o.token_ids for o in generate(pairs["dense"], "ar", 1, params, False, max_batch=4, prompts=prompts)]
        for llm in compiled:
            assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.slow
def test_compiled_stack_samples_as_ar(pairs, compiled):
    """Seeded top-k/top-p sampling through the compiled stack: every request gets the tokens
    uncompiled AR gives it."""
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=8, max_tokens=32, ignore_eos=True, seed=7)
    ref = [o.token_ids for o in generate(pairs["dense"], "ar", 1, params, False, max_batch=4)]
    for llm in compiled:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref


@pytest.mark.slow
def test_a_second_model_reuses_the_compiled_graph_with_its_own_weights(pairs, compiled, tmp_path):
    """A second target of the same shape finds the first one's graph (no compile at start-up) and
    runs it over its own weights: its tokens are its own uncompiled AR's, not the first target's."""
    other = (str(make_target(tmp_path / "other", vocab=VOCAB, logit_scale=3.0, seed=1)), pairs["dense"][1])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    before = counters["stats"]["unique_graphs"]
    llm = LLM(*other, method="ddtree", budget=16, device="cpu", max_batch=4, max_model_len=192, compile=True)
    assert counters["stats"]["unique_graphs"] == before and llm.engine.runner.target.compiled is not None
    ref = [o.token_ids for o in generate(other, "ar", 1, params, False, max_batch=4)]
    assert ref != [o.token_ids for o in generate(pairs["dense"], "ar", 1, params, False, max_batch=4)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref


@pytest.mark.skipif(compiled_module._set_stance is None, reason="this torch cannot skip guard checks")
def test_warmed_stacks_check_only_the_guards_that_tell_variants_apart():
    """Once start-up has compiled every variant, a compiled forward runs with dynamo checking only the
    guards that tell them apart, and leaves the compiler's stance as it found it; unwarmed, or with
    autograd on (it was warmed in inference mode), every guard is checked. (The tests above run their
    compiled rounds this way and give AR's tokens.)"""
    from torch._dynamo import eval_frame

    run_with = compiled_module.run_with

    def skipping(*_):
        return eval_frame._stance.skip_guard_eval_unsafe

    with torch.inference_mode():
        assert run_with(skipping, None, warmed=True) and not run_with(skipping, None, warmed=False)
    assert not run_with(skipping, None, warmed=True)
    assert not eval_frame._stance.skip_guard_eval_unsafe


@pytest.mark.skipif(compiled_module._set_stance is None, reason="this torch cannot skip guard checks")
def test_a_warmed_stack_meeting_a_shape_start_up_missed_compiles_it():
    """Under the guard-skipping stance dynamo refuses to compile; a warmed call that meets a shape start-up
    did not compile (none should exist) compiles it as an unwarmed one would, rather than failing the request."""
    double = compiled_module.compiled(lambda x: x * 2 + 1)
    with torch.inference_mode():
        assert compiled_module.run_with(double, None, torch.ones(3), warmed=False).tolist() == [3.0] * 3
        assert compiled_module.run_with(double, None, torch.ones(1, 2), warmed=True).tolist() == [[3.0, 3.0]]


def test_a_failed_compile_is_one_clear_error(pairs, monkeypatch):
    """Where inductor cannot compile (no C++ compiler, say), compile=True stops with one line that
    names the cause and the way out."""
    from flashtree.errors import FlashtreeError

    def broken(fn):
        def run(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")
        return run

    monkeypatch.setattr(compiled_module, "compiled", broken)
    target, drafter = pairs["dense"]
    with pytest.raises(FlashtreeError) as err:
        LLM(target, drafter, method="dflash", device="cpu", max_batch=2, max_model_len=64, compile=True)
    message = str(err.value)
    assert "\n" not in message and "No working C++ compiler found" in message and "--compile" in message


def test_a_replay_overwrites_its_outputs():
    """The CPU stand-in keeps a CUDA graph's aliasing: a result read after the next replay holds
    the next replay's values, so code that keeps one past it fails here as it would on a GPU."""
    box = {"x": torch.tensor([1.0])}
    piece = Piece(lambda: {"y": box["x"] * 2}, pool=None, cuda=False, shared={}, names=("y",))
    first = piece.replay()["y"]
    box["x"] = torch.tensor([5.0])
    piece.replay()
    assert first.item() == 10.0


def test_rounds_are_captured_for_every_batch_and_key_bucket(pairs):
    target, drafter = pairs["dense"]
    llm = LLM(target, drafter, method="dflash", device="cpu", max_batch=3, max_model_len=192, capture=True)
    graphs = llm.engine.runner.graphs
    keys = sorted({k for _, k, _ in graphs.rounds})
    assert sorted({b for b, _, _ in graphs.rounds}) == [1, 2, 4] and {a for _, _, a in graphs.rounds} == {None}
    assert keys[-1] == llm.engine.runner.cache.max_len and keys[0] == 128
    assert llm.engine.capture_seconds > 0


def auto_engine(pair, max_batch=3, max_round_tokens=4096):
    return LLM(*pair, method="ddtree", budget="auto", device="cpu", max_batch=max_batch, max_model_len=192,
               capture=True, cost_cache="off", max_round_tokens=max_round_tokens)


def test_auto_captures_every_arm_it_may_play(pairs):
    """budget="auto" captured: per batch bucket, AR steps, the chain and every power-of-two tree up to
    max_budget whose window fits max_round_tokens at the bucket's fewest real rows, and only those."""
    llm = auto_engine(pairs["dense"], max_batch=4, max_round_tokens=40)
    runner = llm.engine.runner
    policy = runner.policy
    assert policy.grid == [1 << i for i in range(len(policy.grid))] and policy.grid[-1] == runner.config.max_budget
    assert runner.deferred is None  # a captured round appends every row's drafter context
    for b in (1, 2, 4):
        arms = {a for rb, _, a in runner.graphs.rounds if rb == b}
        fits = {a for a in range(policy.chain_arm + 1) if policy.arm_plan(a, b).window <= 40 // (b // 2 + 1)}
        assert arms == fits | {None}
    assert policy.chain_arm in {a for _, _, a in runner.graphs.rounds}  # the chain's window (8) fits every bucket
    # Plans are priced by their captured round's replay at the batch bucket, whichever rows draft.
    plans = [(b, runner.captured_plan(a, b)) for b, _, a in runner.graphs.rounds]
    assert set(policy.cost.replays) == {(b, p.window, p.budget > 0) for b, p in plans}
    ar, table = policy.seconds(3)
    assert ar == pytest.approx(policy.cost.replays[4, 1, False])
    chain = policy.cost.replays[4, policy.arm_plan(policy.chain_arm, 3).window, False]
    assert table[policy.chain_arm, 1] == table[policy.chain_arm, 3] == pytest.approx(chain)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_auto_captured_rounds_of_every_arm_give_ar_tokens(pairs, kind, temperature):
    """Captured auto rounds, each round a different arm (AR steps, the chain, every tree size) with a
    different subset of the rows drafting (the rest drop their drafts): every request gets the tokens
    uncaptured AR gives it, greedy and seeded, and the drafted nodes that rows keep are committed."""
    from dataclasses import replace

    params = SamplingParams(temperature=temperature, top_k=8, max_tokens=40, ignore_eos=True, seed=7)
    ref = [o.token_ids for o in generate(pairs[kind], "ar", 1, params, captured=False)]
    llm = auto_engine(pairs[kind])
    runner, policy = llm.engine.runner, llm.engine.runner.policy
    turn = iter(range(10**6))
    planned = []
    captured = {(b, a) for b, _, a in runner.graphs.rounds}

    def plan(reqs):
        i, R = next(turn), len(reqs)
        arm = [None, *range(policy.chain_arm + 1)][i % (policy.chain_arm + 2)]
        rows = [r for r in range(R) if (i >> r) & 1 or R == 1]
        if arm is None or not rows or (batch_bucket(R), arm) not in captured:
            return fixed_plan(R, "ar", runner.block_size, 0)
        base = policy.arm_plan(arm, R)
        modes = [base.modes[0] if r in rows else 0 for r in range(R)]
        planned.append((arm, len(rows), R))
        return replace(base, modes=modes, draft_rows=rows, tree_rows=len(rows) if base.tree_rows else 0)

    policy.plan = plan
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ref
    assert {a for a, _, _ in planned} == set(range(policy.chain_arm + 1))  # every arm was played
    assert any(k < R for _, k, R in planned)  # with some rows on AR steps beside drafting ones
    assert max(max(o.stats.accept_lengths) for o in outs) >= 2
    # A row on AR steps emits its root's pick alone, even in a round where other rows draft.
    assert all(n == 1 for o in outs for m, n in zip(o.stats.modes, o.stats.accept_lengths) if m == "ar")


def test_auto_captured_plays_its_own_plans_and_keeps_ar_tokens(pairs):
    """The policy itself planning captured rounds (priced at the batch bucket, every row drafting):
    greedy requests through three slots keep AR's tokens, and it drafts."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = [o.token_ids for o in generate(pairs["dense"], "ar", 1, params, captured=False)]
    llm = auto_engine(pairs["dense"])
    assert llm.engine.runner.policy.cost.bucket(3) == 4
    outs = llm.generate(PROMPTS * 2, params)
    assert [o.token_ids for o in outs] == ref * 2
    assert any(m != "ar" for o in outs for m in o.stats.modes)


def test_auto_captured_serves_samples_logprobs_and_shared_prefixes(pairs):
    """Captured auto under what a server asks of it: n = 2 seeded samples of each prompt, logprobs,
    and a prompt sharing an earlier one's prefix (reused from the cache): eager auto's tokens and
    logprobs."""
    params = SamplingParams(temperature=0.8, top_k=8, max_tokens=24, ignore_eos=True, seed=3, n=2, logprobs=2)
    first, later = [list(range(1, 15))], [list(range(1, 15)) + [3, 4], [5, 6] * 9]
    outs = {}
    for captured in (False, True):
        llm = LLM(*pairs["dense"], method="ddtree", budget="auto", device="cpu", max_batch=4, max_model_len=192,
                  capture=captured, cost_cache="off")
        outs[captured] = llm.generate(first, params) + llm.generate(later, params)
    for eager, replayed in zip(outs[False], outs[True]):
        assert [o.token_ids for o in replayed.outputs] == [o.token_ids for o in eager.outputs]
        for a, b in zip(eager.outputs, replayed.outputs):
            assert [t.token for t in b.logprobs] == [t.token for t in a.logprobs]
            assert [t.logprob for t in b.logprobs] == pytest.approx([t.logprob for t in a.logprobs], abs=1e-5)
    assert outs[True][1].outputs[0].stats.cached_tokens > 0  # the second prompt reused the first's prefix
