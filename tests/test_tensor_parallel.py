"""Tensor parallelism (flashtree.parallel): 2 ranks on the CPU over gloo, in float64.

The spawned tests share one set of worker processes (started by the first tensor-parallel
engine, ~5 s), so each architecture adds only its loads and generations.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from flashtree import LLM, FlashtreeError, SamplingParams
from flashtree.models.loader import hub_state_dict, load_target
from flashtree.parallel import TensorParallel
from tests.test_moe import make_qwen3_moe
from tests.test_qwen3_5 import make_qwen35
from tests.tiny import make_drafter, make_target

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    drafter = make_drafter(root / "drafter", target_layers=4, vocab=64, hidden=32, block_size=6, layer_ids=[1, 2])
    return {
        "qwen3": make_target(root / "qwen3", "qwen3", seed=3, logit_scale=4.0),
        # One K/V head for two ranks: each rank keeps it. Biases on attention and MLP: the
        # row-parallel ones must count once.
        "llama": make_target(root / "llama", "llama", seed=7, kv_heads=1, logit_scale=4.0, attention_bias=True,
                             mlp_bias=True),
        "qwen3_5": make_qwen35(root / "qwen3_5", seed=11, logit_scale=4.0)[0],
        "qwen3_moe": make_qwen3_moe(root / "qwen3_moe", seed=11, logit_scale=4.0)[0],
    }, drafter


def test_each_rank_reads_only_its_slice(tmp_path):
    """Two ranks' shards of a hybrid (GDN + gated attention) target hold half the sharded weights
    each, and put together along the split dim they are the full model's tensors."""
    path, _ = make_qwen35(tmp_path / "t", seed=2)
    full = hub_state_dict(load_target(path, torch.float64, CPU))  # under the checkpoint's names
    ranks = [hub_state_dict(load_target(path, torch.float64, CPU, tp=TensorParallel(r, 2, CPU))) for r in range(2)]
    assert sum(p.numel() for p in ranks[0].values()) < 0.6 * sum(p.numel() for p in full.values())

    def joined(name: str, dim: int) -> torch.Tensor:
        return torch.cat([r[name] for r in ranks], dim=dim)

    gdn = next(k for k in full if "linear_attn.out_proj" in k)
    assert torch.equal(joined(gdn, 1), full[gdn])  # row-parallel: input columns
    for name in ("embed_tokens.weight", "lm_head.weight", gdn.replace("out_proj", "in_proj_z"),
                 gdn.replace("out_proj.weight", "A_log")):
        assert torch.equal(joined(name, 0), full[name]), name
    qkv = gdn.replace("out_proj", "in_proj_qkv")  # q, k, v sections split alike, conv channels with them
    q, k, v = (full[qkv].split([16, 16, 32]))
    for r, rank in enumerate(ranks):
        mine = torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]])
        assert torch.equal(rank[qkv], mine)
        conv = qkv.replace("in_proj_qkv", "conv1d")
        assert torch.equal(rank[conv], torch.cat([t.chunk(2)[r] for t in full[conv].split([16, 16, 32])]))
    norm = next(k for k in full if k.endswith("input_layernorm.weight"))
    assert all(torch.equal(r[norm], full[norm]) for r in ranks)  # replicated


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_moe"])
def test_two_ranks_generate_what_one_does(models, arch, monkeypatch):
    """ar, dflash, ddtree and ddtree with budget="auto", batched, greedy and sampled: the tokens
    with tensor_parallel_size=2 are those of 1, and (FLASHTREE_TP_CHECK) after every call both
    ranks returned the same result and hold the same cache lengths."""
    monkeypatch.setenv("FLASHTREE_TP_CHECK", "1")
    import flashtree.parallel.workers as workers

    if workers._cluster is not None and not workers._cluster.check_results:
        workers._cluster.close()  # started without the check by another test
    paths, drafter = models
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 62, (n,), generator=gen).tolist() for n in (3, 17, 40, 8)]
    params = [SamplingParams(temperature=t, max_tokens=20, ignore_eos=True, seed=i)
              for i, t in enumerate((0.0, 1.0, 0.0, 0.7))]
    common = dict(target=str(paths[arch]), drafter=str(drafter), device="cpu", dtype="float64", max_batch=3,
                  max_model_len=96)
    accepted = 0
    for method, budget in [("ar", 8), ("dflash", 8), ("ddtree", 8), ("ddtree", "auto")]:
        out = {}
        for tp in (1, 2):
            llm = LLM(method=method, budget=budget, max_budget=16, tensor_parallel_size=tp, **common)
            out[tp] = llm.generate(prompts, params)
        assert [o.token_ids for o in out[2]] == [o.token_ids for o in out[1]], method
        assert all(len(o.token_ids) == 20 for o in out[2])
        accepted = max(accepted, max(max(o.stats.accept_lengths) for o in out[2]))
    assert accepted > 1  # the trees accepted drafted tokens: the walk saw real logits


@pytest.mark.slow
def test_two_ranks_replay_captured_auto_rounds_alike(models, monkeypatch):
    """budget="auto" with captured rounds over two ranks: every rank replays the same arm each round
    (rank 0's replay timings, like its cost tables, are every rank's), so the tokens are AR's,
    greedy and sampled, and (FLASHTREE_TP_CHECK) both ranks return the same results."""
    monkeypatch.setenv("FLASHTREE_TP_CHECK", "1")
    import flashtree.parallel.workers as workers

    if workers._cluster is not None and not workers._cluster.check_results:
        workers._cluster.close()
    paths, drafter = models
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 62, (n,), generator=gen).tolist() for n in (3, 17, 40, 8)]
    params = [SamplingParams(temperature=t, max_tokens=20, ignore_eos=True, seed=i)
              for i, t in enumerate((0.0, 1.0, 0.0, 0.7))]
    common = dict(target=str(paths["qwen3"]), drafter=str(drafter), device="cpu", dtype="float64", max_batch=3,
                  max_model_len=96)
    ref = [o.token_ids for o in LLM(method="ar", **common).generate(prompts, params)]
    llm = LLM(method="ddtree", budget="auto", max_budget=16, tensor_parallel_size=2, capture=True, cost_cache="off",
              **common)
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == ref
    assert max(max(o.stats.accept_lengths) for o in out) > 1


@pytest.mark.slow
def test_a_dead_worker_is_a_clear_error(models):
    """A worker killed between rounds, or while rank 0 waits on it inside a collective, ends the
    next generate with one line naming the worker and its exit code (not a hang); the next
    tensor-parallel engine starts fresh workers."""
    import flashtree.parallel.workers as workers

    paths, drafter = models
    common = dict(target=str(paths["qwen3"]), drafter=str(drafter), device="cpu", dtype="float64", max_model_len=96,
                  tensor_parallel_size=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    message = r"tensor-parallel worker 1 exited with code -9; see its log above"

    llm = LLM(**common)
    os.kill(workers._cluster.procs[0].pid, signal.SIGKILL)
    workers._cluster.procs[0].wait()
    with pytest.raises(FlashtreeError, match=message):
        llm.generate([[1, 2, 3]], params)

    llm = LLM(**common)  # fresh workers
    assert len(llm.generate([[1, 2, 3]], params)[0].token_ids) == 40
    runner = llm.engine.runner.runner
    step = runner.step

    def kill_then_step(self, *args, **kwargs):  # the worker has the call; rank 0 enters its collectives
        os.kill(workers._cluster.procs[0].pid, signal.SIGKILL)
        return step(*args, **kwargs)

    runner.step = types.MethodType(kill_then_step, runner)
    with pytest.raises(FlashtreeError, match=message):
        llm.generate([[1, 2, 3]], params)


SCRIPT = """from flashtree import LLM, SamplingParams
llm = LLM(target={target!r}, drafter={drafter!r}, method="ddtree", budget="auto", max_budget=16, cost_cache="off",
          device="cpu", dtype="float64", max_model_len=96, tensor_parallel_size=2)
print("TOKENS", llm.generate([[1, 2, 3]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stdin", "no main guard", "python -c"])
def test_tensor_parallel_from_any_kind_of_main(models, tmp_path, how):
    """LLM(tensor_parallel_size=2) from a script piped on stdin, a script without an
    `if __name__ == "__main__":` guard (as the README's example is written) and `python -c`:
    the workers never re-import the user's main module, so each prints its tokens, with no
    traceback, and gives the tokens of one rank. Rank 0 alone prints the start-up cost
    measurement line."""
    paths, drafter = models
    code = SCRIPT.format(target=str(paths["qwen3"]), drafter=str(drafter))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = tmp_path / "generate.py"
    script.write_text(code)
    argv = {"stdin": [sys.executable, "-"], "no main guard": [sys.executable, str(script)],
            "python -c": [sys.executable, "-c", code]}[how]
    run = subprocess.run(argv, input=code if how == "stdin" else None, capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.count("measuring round costs") == 1, run.stderr
    alone = LLM(target=str(paths["qwen3"]), drafter=str(drafter), method="ddtree", budget=8, device="cpu",
                dtype="float64", max_model_len=96).generate([[1, 2, 3]], SamplingParams(max_tokens=12, ignore_eos=True))
    assert run.stdout.strip() == f"TOKENS {alone[0].token_ids}"
