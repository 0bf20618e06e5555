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
from flashtree.engine.graphs import Piece
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


def test_a_failed_compile_is_one_clear_error(pairs, monkeypatch):
    """Where inductor cannot compile (no C++ compiler, say), compile=True stops with one line that
    names the cause and the way out."""
    import flashtree.models.compiled as compiled_module
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
    keys = sorted({k for _, k in graphs.rounds})
    assert sorted({b for b, _ in graphs.rounds}) == [1, 2, 4]
    assert keys[-1] == llm.engine.runner.cache.max_len and keys[0] == 128
    assert llm.engine.capture_seconds > 0
