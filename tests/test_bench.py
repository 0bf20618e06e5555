"""flashtree bench: the metric arithmetic on a hand-made run, the cost curve, suites, and the command end to end.

No timing assertions: only shapes, counts and arithmetic that hold on any machine.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import pytest
import torch

from flashtree.bench import metrics as m
from flashtree.bench.cost import CostCurve, CostPoint, curve_sizes, measure_cost_curve, random_tree
from flashtree.bench.suites import STANDARD, HubSuite, load_suite, read_jsonl
from flashtree.cli import main
from flashtree.config import DEMO_DRAFTER, DEMO_TARGET
from flashtree.errors import FlashtreeError
from tiny import make_drafter, make_target, synthetic_cost

PNGS = ("speedup", "tau", "accept_hist", "cost_curve", "stages")


def rec(pid: str, lengths: list[int], wall: float, stages: dict[str, float], out: list[int] | None = None):
    return m.RequestRecord(pid, 10, sum(lengths), wall, lengths, stages, "length", out or [])


# ---- metric arithmetic on a fake run -------------------------------------------------------------

A = rec("p0", [1, 3, 2], 1.0, {"prefill": 0.1, "draft": 0.3, "tree": 0.06, "verify": 0.3, "commit": 0.06}, [5, 6])
B = rec("p1", [4], 1.0, {"prefill": 0.1, "draft": 0.1, "tree": 0.02, "verify": 0.1, "commit": 0.02}, [7])


def test_tau_throughput_and_stage_split():
    assert m.tau([A, B]) == pytest.approx(10 / 4)  # round-weighted: (1+3+2+4) / 4 rounds
    assert m.tokens_per_second([A, B]) == pytest.approx(10 / 2.0)
    per_round = m.stage_seconds_per_round([A, B])
    assert per_round == pytest.approx({"draft": 0.1, "tree": 0.02, "verify": 0.1, "commit": 0.02})
    assert m.round_seconds(per_round) == pytest.approx(0.24)
    assert m.overhead_share(per_round) == pytest.approx(0.04 / 0.24)
    # wall 2.0, inside prefill + stages = 0.2 + 0.96 -> 0.84 outside
    assert m.outside_rounds_share([A, B]) == pytest.approx(0.84 / 2.0)
    assert m.tau([]) == 0.0 and m.overhead_share(dict.fromkeys(m.ROUND_STAGES, 0.0)) == 0.0


def test_accept_histogram():
    assert m.accept_histogram([A, B], max_len=6) == [1, 1, 1, 1, 0, 0]
    assert m.accept_histogram([A, B]) == [1, 1, 1, 1]  # grows to the longest seen
    assert m.fractions([1, 1, 2, 0]) == [0.25, 0.25, 0.5, 0.0]


def test_speedups_by_hand():
    assert m.speedup(30.0, 12.0) == pytest.approx(2.5)
    assert m.speedup(1.0, 0.0) is None
    # tau 2.5, T_ar 10 ms, draft 2 + verify 12 + overhead 1 = 15 ms -> 2.5 * 10 / 15
    assert m.predicted_speedup(2.5, 10.0, 2.0, 12.0, 1.0) == pytest.approx(5 / 3)
    # decode: 2.5 tokens / 15 ms vs 1 token / 10 ms
    assert m.decode_speedup(2.5, 15.0, 10.0) == pytest.approx(5 / 3)


def test_interpolate_cost_curve():
    pts = [(1, 1.0), (3, 2.0), (9, 8.0)]
    assert m.interpolate(pts, 1) == 1.0
    assert m.interpolate(pts, 2) == pytest.approx(1.5)
    assert m.interpolate(pts, 5) == pytest.approx(4.0)
    assert m.interpolate(pts, 0) == 1.0 and m.interpolate(pts, 100) == 8.0


def test_summaries_compare_to_ar():
    ar = [rec("p0", [1] * 10, 1.0, {"prefill": 0.1, "draft": 0.0, "tree": 0.0, "verify": 0.08, "commit": 0.02}, [1])]
    tree = [rec("p0", [4, 4, 2], 0.5, {"prefill": 0.1, "draft": 0.06, "tree": 0.03, "verify": 0.18, "commit": 0.03}, [1])]
    cells = [m.summarize("s", 0.0, "ar", None, 1, ar, 8), m.summarize("s", 0.0, "ddtree", 16, 17, tree, 8)]
    # The curve, timed alone: 1 node 4 ms, 17 nodes 25 ms; the run's ar verify (8 ms) sets the scale x2.
    m.compare_to_ar(cells, lambda method, nodes, t: {1: 4.0, 17: 25.0}[nodes])
    a, d = cells
    assert a.round_ms == pytest.approx(10.0) and d.round_ms == pytest.approx(100.0)
    assert d.tau == pytest.approx(10 / 3)
    assert d.stage_ms_per_round == pytest.approx({"draft": 20.0, "tree": 10.0, "verify": 60.0, "commit": 10.0})
    assert d.overhead_share == pytest.approx(0.2)
    assert d.speedup == pytest.approx((10 / 0.5) / (10 / 1.0))
    assert d.decode_speedup == pytest.approx((10 / 3 / 100.0) / (1 / 10.0))
    # T_ar_step = ar's round 10; denominator = draft 20 + 2 x curve(17) 50 + overhead 20
    assert d.predicted_verify_ms == 50.0
    assert d.predicted_speedup == pytest.approx((10 / 3) * 10.0 / 90.0)
    assert a.predicted_speedup == pytest.approx(1.0) and a.speedup == pytest.approx(1.0)
    assert d.accept_counts == [0, 1, 0, 2, 0, 0, 0, 0] and d.label == "ddtree-16"


def test_prediction_without_ar_uses_the_curve_as_is():
    tree = [rec("p0", [3, 3], 1.0, {"prefill": 0.0, "draft": 0.002, "tree": 0.001, "verify": 0.1, "commit": 0.001})]
    (d,) = cells = [m.summarize("s", 0.0, "ddtree", 8, 9, tree, 8)]
    m.compare_to_ar(cells, lambda method, nodes, t: {1: 2.0, 9: 4.0}[nodes])
    # T_ar_step = curve(1) = 2; denominator = draft 1 + curve(9) 4 + overhead 1 -> 3 * 2 / 6
    assert d.speedup is None and d.predicted_verify_ms == 4.0
    assert d.predicted_speedup == pytest.approx(1.0)


def test_match_fraction():
    ref = [rec("a", [1], 1, {}, [1, 2]), rec("b", [1], 1, {}, [3])]
    mine = [rec("b", [1], 1, {}, [3]), rec("a", [1], 1, {}, [1, 9])]
    assert m.match_fraction(mine, ref) == 0.5


# ---- cost curve ----------------------------------------------------------------------------------

def test_curve_sizes_cover_budgets():
    sizes = curve_sizes(65, [4, 16, 64], dense=False)
    assert sizes[0] == 1 and sizes[-1] == 65 and {5, 17, 65} <= set(sizes)
    assert set(curve_sizes(65, [], dense=True)) >= {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 65}


def test_cost_point_lookup():
    curve = CostCurve(100, 3, 7, tree=[CostPoint(1, 1.0, 1.0, {"0.0": 0.1}), CostPoint(9, 3.0, 3.0, {"0.0": 0.3})],
                      chain=[CostPoint(1, 0.5, 0.5, {"0.0": 0.0}), CostPoint(8, 0.9, 0.9, {"0.0": 0.0})])
    assert curve.verify_ms("ddtree", 5) == pytest.approx(2.2)
    assert curve.verify_ms("dflash", 8) == pytest.approx(0.9)
    assert curve.verify_ms("ar", 1) == pytest.approx(0.5)
    curve.chain[0] = CostPoint(1, 2.0, 2.0, {"0.0": 0.0})  # a noisy chain point: n = 1 takes the faster
    assert curve.verify_ms("ar", 1) == pytest.approx(1.1) and curve.verify_ms("ddtree", 1) == pytest.approx(1.1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = make_target(root / "target", logit_scale=4.0)
    drafter = make_drafter(root / "drafter", target_layers=4, block_size=8)
    return target, drafter


def test_cost_curve_measures_requested_sizes(pair):
    from flashtree import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(target=str(pair[0]), drafter=str(pair[1]), method="ddtree", max_batch=1,
                                    max_model_len=64))
    for n in (1, 2, 9, 33):
        spec = random_tree(n, 7, engine.target.vocab_size, engine.device, torch.Generator().manual_seed(n))
        assert int(spec.sizes[0]) == n == spec.num_nodes
    curve = measure_cost_curve(engine.target, engine.drafter, [1, 5, 17], [1, 8], 20, [0.0, 1.0], repeats=2,
                               warmup=1)
    assert [p.nodes for p in curve.tree] == [1, 5, 17] and [p.nodes for p in curve.chain] == [1, 8]
    assert curve.depth == 7 and curve.context_len == 20
    for p in curve.tree + curve.chain:
        assert p.forward_ms > 0 and set(p.pick_ms) == {"0.0", "1.0"}
        assert p.forward_ms <= p.forward_median_ms


# ---- suites --------------------------------------------------------------------------------------

def test_builtin_suites_load():
    for name in ("code", "prose"):
        prompts = load_suite(name, 5)
        assert len(prompts) == 5 and all(p.text and p.suite == name and not p.chat for p in prompts)
    assert len(load_suite("code")) == 40


def test_jsonl_suite(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt_ids": [1, 2, 3]}\n\n{"id": "x", "prompt": "hello", "chat": true}\n')
    a, b = read_jsonl(path, "mine")
    assert a.token_ids == [1, 2, 3] and a.id == "mine-000" and b.text == "hello" and b.chat and b.id == "x"
    assert len(load_suite(str(path), 1)) == 1
    path.write_text('{"nope": 1}\n')
    with pytest.raises(FlashtreeError, match="needs a 'prompt'"):
        load_suite(str(path))
    with pytest.raises(FlashtreeError, match="unknown suite"):
        load_suite("no-such-suite")


def test_standard_suite_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(FlashtreeError, match="pip install datasets"):
        load_suite("gsm8k", 2)


def test_standard_suite_offline_fails_in_one_line(monkeypatch):
    pytest.importorskip("datasets")
    import flashtree.bench.suites as suites

    monkeypatch.setattr(suites, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setitem(STANDARD, "gsm8k", HubSuite("flashtree-tests/not-a-dataset", None, "test", lambda r: ""))
    with pytest.raises(FlashtreeError, match="could not load suite 'gsm8k'") as e:
        load_suite("gsm8k", 2)
    assert "\n" not in str(e.value)


# ---- the command end to end ----------------------------------------------------------------------

def check_outputs(out, methods: set[str]) -> dict:
    data = json.loads((out / "results.json").read_text())
    assert {c["method"] for c in data["cells"]} == methods
    env = data["environment"]
    assert env["torch"] == torch.__version__ and env["device"] and env["dtype"] and env["torch_threads"] >= 1
    for c in data["cells"]:
        assert c["rounds"] > 0 and c["tau"] >= 1.0 and c["tokens_per_s"] > 0
        assert sum(c["accept_counts"]) == c["rounds"]
        if c["method"] == "ar":
            assert c["tau"] == 1.0 and c["speedup"] == pytest.approx(1.0)
        if c["temperature"] == 0 and c["method"] != "ar":
            assert c["matches_ar"] == 1.0  # greedy speculative decoding is lossless
    # The reported tau is the pooled per-request accept lengths.
    cell = next(c for c in data["cells"] if c["method"] == "ddtree")
    reqs = [r for r in data["requests"] if r["suite"] == cell["suite"] and r["cell"] == cell["label"]
            and r["temperature"] == cell["temperature"]]
    lengths = [a for r in reqs for a in r["accept_lengths"]]
    assert cell["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert data["cost_curve"]["tree"][0]["nodes"] == 1
    for name in PNGS:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "results.md").read_text().startswith("flashtree bench")
    return data


def test_bench_command_on_tiny_pair(pair, tmp_path, capsys):
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [3 + i, 7, 11, 2 * i]}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(pair[0]), "--drafter", str(pair[1]), "--quick", "--suites",
               str(prompts), "--budgets", "16,4,auto", "--num-prompts", "2",
               "--max-tokens", "12", "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| suite | T | method |" in table and "ddtree" in table
    data = check_outputs(out, {"ar", "dflash", "ddtree"})
    assert data["spec"]["budgets"] == [16, 4, "auto"] and data["spec"]["temperatures"] == [0.0, 1.0]
    # 2 temperatures x (ar, dflash, ddtree-4, ddtree-16, ddtree-auto), in that order
    assert [c["label"] for c in data["cells"]][:5] == ["ar", "dflash", "ddtree-4", "ddtree-16", "ddtree-auto"]
    assert len(data["cells"]) == 2 * 5
    auto = [c for c in data["cells"] if c["budget"] == "auto"]
    assert all(c["tree_nodes"] is None and c["predicted_speedup"] is None and c["speedup"] for c in auto)
    # The JSON holds enough to redraw every plot without measuring again.
    from flashtree.bench.plots import write_plots
    from flashtree.bench.report import result_from_json

    again = result_from_json(data)
    assert [c.label for c in again.cells] == [c["label"] for c in data["cells"]] and again.suites == ["ids"]
    paths = write_plots(again, tmp_path, "re_")
    assert sorted(p.name for p in paths) == sorted(f"re_{n}.png" for n in PNGS)


def test_bench_command_rejects_bad_input(pair, tmp_path, capsys):
    base = ["bench", "--target", str(pair[0]), "--drafter", str(pair[1]), "--out", str(tmp_path)]
    assert main(base + ["--methods", "ar,beam"]) == 2
    assert main(base + ["--suites", "nope"]) == 2
    assert main(base + ["--budgets", "0"]) == 2
    assert main(base + ["--temperatures", "-1"]) == 2
    assert main(base + ["--max-tokens", "0"]) == 2
    assert main(base + ["--num-prompts", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("flashtree: error:") == 6 and "Traceback" not in err
    assert "temperatures must be >= 0" in err and "max_tokens, num_prompts" in err
    with pytest.raises(SystemExit):  # argparse: not a budget
        main(base + ["--budgets", "8,big"])
    assert "integers or 'auto'" in capsys.readouterr().err


DEMO_READY = (DEMO_TARGET / "config.json").is_file() and (DEMO_DRAFTER / "config.json").is_file()


@pytest.mark.skipif(not DEMO_READY, reason="the demo pair is not trained yet (flashtree/assets/demo/{target,drafter})")
def test_bench_quick_on_demo_pair(tmp_path):
    out = tmp_path / "quick"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    data = check_outputs(out, {"ar", "dflash", "ddtree"})
    assert {c["suite"] for c in data["cells"]} == {"code", "prose", "all"}


def test_policy_grid_keeps_concurrency_and_equal_tokens(pair, tmp_path, capsys):
    """`bench --policy-grid` on the tiny pair: every (T, c, method) cell runs, each produces the
    same tokens (seed-exact sampling), and a stream keeps c requests in flight: the batch is
    c wide in every round until fewer than c prompts are left. A cell runs at least a stream's
    worth of requests."""
    from flashtree import EngineConfig, LLMEngine, SamplingParams
    from flashtree.bench.policy_grid import CHUNK, GridCell, run_stream

    engine = LLMEngine(EngineConfig(target=str(pair[0]), drafter=str(pair[1]), device="cpu", max_batch=3,
                                    max_model_len=64))
    sizes, step = [], engine.step

    def counted():
        out = step()
        if engine.last_round is not None:
            sizes.append(engine.last_round.batch_size)
        return out

    engine.step = counted
    prompts = [[3 + i, 7, 11] for i in range(7)]
    params = [SamplingParams(max_tokens=5 + i % 3, ignore_eos=True) for i in range(7)]
    cell = GridCell(0.0, 3, "auto")
    run_stream(engine, prompts, params, cell, 3)
    assert cell.tokens == sum(p.max_tokens for p in params) and len(cell.outputs) == 7
    assert max(sizes) == 3 and sizes[: sizes.index(3) + 1][-1] == 3
    full = sizes[sizes.index(3):]
    assert all(s == 3 for s in full[: len(full) - 6])  # only the last prompts' rounds run narrower

    out = tmp_path / "grid"
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"prompt_ids": [3 + i, 7, 11, 2 * i]}) + "\n" for i in range(4)))
    rc = main(["bench", "--policy-grid", "--target", str(pair[0]), "--drafter", str(pair[1]), "--suites", str(ids),
               "--temperatures",
               "0,0.8", "--concurrency", "1,3", "--budgets", "4", "--num-prompts", "4", "--max-tokens", "6",
               "--passes", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert len(data["summary"]) == 4 and all(r["same_tokens"] for r in data["summary"])
    assert {c["label"] for c in data["cells"]} == {"ar", "dflash", "ddtree-4", "auto", "ar-twin"}
    assert all(r["best"] != "ar-twin" and r["twin_vs_ar"] > 0 for r in data["summary"])
    # c = 3 has fewer prompts than a stream (CHUNK x 3): they are reused, so the batch refills.
    assert all(c["tokens"] == (4 if c["concurrency"] == 1 else CHUNK * 3) * 6 for c in data["cells"])
    assert "| T | c |" in capsys.readouterr().out


def test_interleaved_turns_last_a_slice_and_a_few_steps():
    """run_interleaved: each turn runs at least turn_steps steps and until slice_seconds have
    passed, every stream runs to its end, and the turns alternate between the streams."""
    from flashtree.bench.policy_grid import run_interleaved

    log: list[str] = []

    class Fake:
        def __init__(self, name: str, steps: int, seconds: float) -> None:
            self.name, self.left, self.seconds = name, steps, seconds

        def step(self) -> bool:
            log.append(self.name)
            time.sleep(self.seconds)
            self.left -= 1
            return self.left > 0

    run_interleaved([Fake("a", 30, 0.001), Fake("b", 30, 0.004)], slice_seconds=0.01, turn_steps=4)
    assert log.count("a") == 30 and log.count("b") == 30
    # Runs of one stream's steps (two of its turns back to back, across a new pass's order, make one).
    runs = [(k, len(list(g))) for k, g in itertools.groupby(log)]
    for name in "ab":
        mine = [n for k, n in runs if k == name]
        assert len(mine) >= 3  # the slice ends turns: no stream runs in one go
        assert all(n >= 4 for n in mine[:-1])  # only a stream's last turn may be shorter


def test_bench_passes_compile_to_every_cell_engine(capsys):
    """`flashtree bench --compile` gives every cell's engine compile=True (it was once parsed and
    dropped); the policy grid, which runs eagerly, refuses it in one line."""
    from flashtree.bench.cli import spec_from_args
    from flashtree.bench.grid import _engine_config
    from flashtree.cli import build_parser

    spec = spec_from_args(build_parser().parse_args(["bench", "--quick", "--compile"]))
    assert spec.compile and _engine_config(spec, "ddtree", 16, None).compile
    assert not _engine_config(spec_from_args(build_parser().parse_args(["bench", "--quick"])), "ar", 1, None).compile
    assert main(["bench", "--policy-grid", "--compile"]) != 0
    assert "drop --compile" in capsys.readouterr().err


def test_bench_passes_no_pack_weights_to_every_cell_engine():
    """`flashtree bench --no-pack-weights` reaches each cell's engine and the policy grid's engines."""
    from flashtree.bench.cli import spec_from_args
    from flashtree.bench.grid import _engine_config
    from flashtree.bench.policy_grid import PolicyGridSpec, _config
    from flashtree.cli import build_parser

    spec = spec_from_args(build_parser().parse_args(["bench", "--quick", "--no-pack-weights"]))
    assert _engine_config(spec, "ddtree", 16, None).pack_weights is False
    assert _engine_config(spec_from_args(build_parser().parse_args(["bench", "--quick"])), "ar", 1, None).pack_weights is None
    assert _config(PolicyGridSpec(pack_weights=False), "auto", 4, None).pack_weights is False


def test_ab_revision_imports_an_earlier_revision_beside_this_one(tmp_path):
    """benchmarks/ab_revision.py's old package: the code of a git revision, renamed throughout (its
    torch.library operators included), imports next to this tree's flashtree without touching it."""
    import importlib
    import importlib.util
    import subprocess
    from pathlib import Path

    import flashtree

    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    spec = importlib.util.spec_from_file_location("ab_revision", root / "benchmarks" / "ab_revision.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    old = ab.old_package("HEAD", tmp_path)
    assert old.__name__.startswith("flashtree_") and old.EngineConfig is not flashtree.EngineConfig
    compiled = importlib.import_module(f"{old.__name__}.models.compiled")  # defines its operators
    assert compiled.__file__.startswith(str(tmp_path))
    assert hasattr(getattr(torch.ops, old.__name__), "window_attention")
    assert flashtree.EngineConfig.__module__.startswith("flashtree.")


def test_gpu_check_reports_vllm_on_the_device(monkeypatch):
    """gpu_check's section 6 says plainly when vLLM is missing on the device, and otherwise reports
    its version and what the plugin's start-up printed (its smoke test), in the markdown report."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import importlib.util

    import gpu_check

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    report = {"device": "cpu", "torch": torch.__version__}
    gpu_check.vllm_checks(gpu_check.Deadline(100), report)
    assert report["vllm"] == {"installed": False}
    assert "vLLM is not installed on this device" in gpu_check.markdown(report)
    report["vllm"] = {"installed": True, "version": "0.32.0", "plugin": "refused: DDTreeConfigError ..."}
    assert "vLLM 0.32.0; the DDTree plugin at start-up: refused: DDTreeConfigError" in gpu_check.markdown(report)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_policy_sim_traces_replay_every_fixed_method_exactly(tmp_path, temperature):
    """benchmarks/policy_sim.py's premise: every method commits the same tokens, so what a top-b tree
    (or the chain) keeps from an output position is fixed, and one trace recorded at the largest budget
    (rounds that verify its tree but commit one token) gives each method's rounds. Replayed, the trace
    gives exactly the tokens per round that real engines at budgets 1..16 and the chain emit, greedy
    and seeded, and the simulator emits each request's max_tokens."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import policy_sim
    from flashtree import EngineConfig, LLMEngine, SamplingParams

    target = make_target(tmp_path / "t", vocab=64, logit_scale=6.0)
    drafter = make_drafter(tmp_path / "d", target_layers=4, vocab=64, block_size=8)
    sizes = policy_sim.sizes_for(16)

    def engine(method: str, budget: int) -> LLMEngine:
        return LLMEngine(EngineConfig(target=str(target), drafter=str(drafter), device="cpu", method=method,
                                      budget=budget, max_budget=16, max_batch=1, max_model_len=128,
                                      prefix_cache=False))

    prompt, params = [3, 1, 4, 1, 5], SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=7)
    trace = policy_sim.record_request(engine("ddtree", 16), engine("dflash", 16), prompt, params, sizes)
    for method, budget in [("dflash", 0)] + [("ddtree", b) for b in sizes]:
        eng = engine(method, budget or 16)
        req = eng.add_request(prompt, params)
        while eng.has_unfinished:
            eng.step()
        column = -1 if method == "dflash" else sizes.index(budget)
        replayed, n = [], 1  # the prefill's token, then one round per trace row reached
        while n < params.max_tokens:
            emitted = min(int(trace[n - 1][column]) + 1, params.max_tokens - n)
            replayed.append(emitted)
            n += emitted
        assert req.stats.accept_lengths[: len(replayed)] == replayed, (method, budget)
    spec = {"temperature": temperature, "prompt": len(prompt), "max_tokens": 40, "seed": 7, "trace": trace}
    cost = synthetic_cost(1e-4)
    for label in ("ar", "dflash", "ddtree-4", "auto"):
        tokens, seconds = policy_sim.simulate_cell([spec, spec], label, cost, 2, False, sizes, 8)
        assert tokens == 2 * 39 and seconds > 0


def test_policy_sim_tells_the_policy_what_a_played_tree_round_would():
    """A replayed tree round tells the policy what the engine's round of that tree does (by_size on its
    own path codes): the counts, and the chain's run along that tree's spine, censored where the spine
    ends before the chain would (a small tree's often does: the recording's largest tree has a deeper
    spine). Where both end together the trace cannot tell whether the played tree's spine goes on, and
    takes it to. The demo pair with its DFlash-1 drafter, whose small trees are bushy; rounds cut to
    the root, as the recording's, so the drafter's context is computed alike."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import policy_sim
    from flashtree import EngineConfig, LLMEngine, SamplingParams
    from flashtree.engine.policy import by_size

    demo = Path(__file__).resolve().parents[1] / "flashtree" / "assets" / "demo"

    def engine(method: str, budget: int) -> LLMEngine:
        return LLMEngine(EngineConfig(target=str(demo / "target"), drafter=str(demo / "drafter-dflash1"), device="cpu",
                                      method=method, budget=budget, max_budget=16, max_batch=1, max_model_len=256,
                                      prefix_cache=False, cost_cache="off"))

    sizes = policy_sim.sizes_for(16)
    big = engine("ddtree", 16)
    prompt = big.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    trace = policy_sim.record_request(big, engine("dflash", 16), prompt, params, sizes)
    spec = {"temperature": 0.0, "prompt": len(prompt), "max_tokens": 48, "seed": 0, "trace": trace}
    cut = 0
    for i, budget in enumerate(sizes):
        codes: list[list[int]] = []
        with policy_sim.root_only_rounds(codes):
            eng = engine("ddtree", budget)
            eng.add_request(prompt, params)
            while eng.has_unfinished:
                eng.step()
        for n, row in enumerate(codes):
            sim = policy_sim.SimRequest(spec, 0)
            sim.req.output_ids = [0] * (n + 1)
            counts, run, censored = sim.measured(list(range(i + 1)))
            real_counts, real_run, real_censored = by_size(row, sizes[: i + 1])
            assert (counts, run) == (real_counts, real_run), (budget, n)
            assert censored == real_censored or (real_censored and counts[-1] == trace[n][-3]), (budget, n)
            cut += run < trace[n][-3]
    assert cut > 0  # small trees' spines did end first


def test_flex_over_the_whole_cache_attends_as_the_gathered_sdpa_does():
    """gpu_check's section 8 compares two decode attentions: FlexAttention over a layer's whole cache,
    each row reading only its own slot's blocks, and the captured rounds' gathered SDPA at the key
    bucket. They must compute the same thing for AR steps and trees, rows on scattered slots at
    lengths on both sides of a key block, or the timing compares nothing."""
    from flashtree.bench.flex_decode import time_flex_decode

    for nodes in (1, 7):
        r = time_flex_decode(torch.device("cpu"), torch.float32, 4, 2, 16, [5, 127, 128, 300], nodes, 512,
                             compiled=False, repeats=1)
        assert r["max_abs_diff"] < 1e-5, nodes
