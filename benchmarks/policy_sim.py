"""budget="auto" replayed off-line: the policy's rounds against every fixed method's, on recorded
acceptance and a measured cost model, with no timing noise.

What a round accepts depends on nothing a method chooses: every method commits the same tokens
(greedy or seeded), so the drafter sees the same context at the same output position, and what a
top-b tree (or the chain) drafted from there would keep is fixed. `record` measures it at every
output position of every request: one ddtree engine at the largest budget whose rounds verify the
whole tree but commit only the root's token (an AR step's), reading what every smaller top-b tree
kept from the accepted path (policy.by_size), and one dflash engine run the same way, reading the
chain's run (a tree's spine can end before the chain would: its run there is only a bound). A
played tree's round then tells the policy what that tree's round would in the engine: the chain's
run along its own spine, cut where the spine ends. `simulate` then plays each
method's rounds over those traces, the batch seated as the engine seats it (all at once, or one
arrival every two rounds), each round priced by a cost model (CostModel.round_seconds: the tables
`auto` measures at start-up, on whatever device built them) plus, for `auto`, the host time of its
own planning (this thread's CPU time, so other jobs do not inflate it); ar, dflash and ddtree-b pay
only their rounds. Prefill is left out (every method pays the same). A cell's ratios are then exact
for that cost model (up to the float rounding by which a real engine's drafter context, computed in
windows of other sizes, can move a near-tie draft): what the policy chose, not how the machine
drifted, so one run compares
changes to the policy that a timed A/B could not tell apart. What it does not see: whatever a real
round costs beyond the model's tables, and the engine's upkeep for `auto` (docs/benchmarks.md).

It also gives the GPU goal of the policy issue, a grid at the Qwen3-8B shape with the demo pair's
acceptance (random 8B weights accept nothing): gpu_check.py simulates the shipped demo traces
with the cost model an 8B-shaped `auto` engine measured on the GPU.

    python benchmarks/policy_sim.py record --out benchmarks/data/demo_traces.npz      # ~6 min, one core
    python benchmarks/policy_sim.py simulate --traces benchmarks/data/demo_traces.npz
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import policy_heldout as H  # noqa: E402
from flashtree import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from flashtree.engine import runner as runner_module  # noqa: E402
from flashtree.engine.cost_model import CostModel  # noqa: E402
from flashtree.engine.policy import GRID, Policy, by_size  # noqa: E402
from flashtree.engine.round_plan import AR, CHAIN, fixed_plan  # noqa: E402
from flashtree.engine.sequence import Request  # noqa: E402
from flashtree.engine.shapes import TREE_BUCKETS  # noqa: E402
from flashtree.tree.walk import WalkResult  # noqa: E402

MAX_BUDGET = 64  # policy_heldout's engines: auto's trees and the largest fixed one
FORMAT = 2  # traces: per row, kept per tree size, the spine's run and end, the chain's run
LABELS = ["ar", "dflash", "ddtree-4", "ddtree-8", "ddtree-16", "ddtree-32", "ddtree-64", "auto"]


def sizes_for(max_budget: int) -> list[int]:
    """The tree sizes auto may play up to max_budget (Policy.grid), which a trace measures."""
    return [b for b in GRID if b < max_budget] + [max_budget]


# ---- recording ----------------------------------------------------------------------------------------


@contextmanager
def root_only_rounds(rows: list, chain: bool = False):
    """While inside, every round's walk is recorded (a tree's path codes, or the chain's accepted
    drafts, appended to `rows`) and then cut to the root, so the round commits one token, the AR
    step's, whatever it accepted."""
    walk = runner_module.accept_walk

    def one_token(spec, picks) -> WalkResult:
        full = walk(spec, picks)
        rows.extend((full.num_nodes - 1).tolist() if chain else runner_module.path_codes(spec, full.path).tolist())
        path = torch.full_like(full.path, -1)
        path[:, 0] = 0
        tokens = torch.full_like(full.tokens, -1)
        tokens[:, 0] = picks[:, 0]
        return WalkResult(path=path, num_nodes=torch.ones_like(full.num_nodes), tokens=tokens)

    runner_module.accept_walk = one_token
    try:
        yield
    finally:
        runner_module.accept_walk = walk


def record_request(eng: LLMEngine, chain: LLMEngine, ids: list[int], params: SamplingParams, sizes: list[int]
                   ) -> np.ndarray:
    """One request's trace from `eng`, a ddtree engine at the budget sizes[-1], and `chain`, a dflash
    engine, both at batch 1: row i is the round that starts with i + 1 output tokens (the first is the
    prefill's): per b in sizes the drafted tokens the top-b tree keeps, the run along its spine and
    whether it reached the spine's end (by_size), and the chain's run."""
    codes: list[list[int]] = []
    runs: list[int] = []
    for engine, rows, is_chain in ((eng, codes, False), (chain, runs, True)):
        with root_only_rounds(rows, is_chain):
            engine.add_request(ids, params)
            while engine.has_unfinished:
                engine.step()
        if len(rows) != params.max_tokens - 1:
            raise RuntimeError(f"policy_sim: {len(rows)} rounds for {params.max_tokens} tokens; the engine must run "
                               "one request at a time, with no stop but max_tokens (ignore_eos)")
    rows = [[*counts, run, end, r] for (counts, run, end), r in zip((by_size(c, sizes) for c in codes), runs)]
    return np.array(rows, np.uint8).reshape(len(codes), len(sizes) + 3)


def record(temperatures: list[float], requests: int, packages: tuple[str, ...], max_budget: int,
           drafter: str | None) -> dict:
    """Every request's trace (record_request) on the demo pair, policy_heldout's prompts and lengths."""
    base = H.engine("ar", 1, None, drafter)
    eng = LLMEngine(EngineConfig(drafter=drafter, method="ddtree", budget=max_budget, max_budget=max_budget,
                                 max_batch=1, max_model_len=1024, prefix_cache=False), share_weights=base)
    chain = LLMEngine(EngineConfig(drafter=drafter, method="dflash", max_batch=1, max_model_len=1024,
                                   prefix_cache=False), share_weights=base)
    sizes = sizes_for(max_budget)
    texts = H.heldout_prompts(requests, packages=packages)
    out = {"format": FORMAT, "sizes": sizes, "block_size": eng.runner.block_size, "packages": list(packages),
           "requests": []}
    for t in temperatures:
        for i, text in enumerate(texts[:requests]):
            ids = base.encode(text)[-400:]
            params = SamplingParams(temperature=t, max_tokens=H.LENGTHS[i % len(H.LENGTHS)], ignore_eos=True,
                                    seed=1000 + i)
            out["requests"].append({"temperature": t, "prompt": len(ids), "max_tokens": params.max_tokens,
                                    "seed": params.seed, "trace": record_request(eng, chain, ids, params, sizes)})
            print(f"recorded T={t} request {i}", file=sys.stderr, flush=True)
    return out


def save_traces(path: Path, data: dict) -> None:
    meta = {k: v for k, v in data.items() if k != "requests"}
    meta["requests"] = [{k: v for k, v in r.items() if k != "trace"} for r in data["requests"]]
    np.savez_compressed(path, meta=json.dumps(meta), **{f"trace{i}": r["trace"] for i, r in enumerate(data["requests"])})


def load_traces(path: Path) -> dict:
    with np.load(path) as z:
        data = json.loads(str(z["meta"]))
        if data.get("format") != FORMAT:
            raise ValueError(f"recorded by an older policy_sim (format {data.get('format', 1)}, this one reads "
                             f"{FORMAT}); record it again")
        for i, r in enumerate(data["requests"]):
            r["trace"] = z[f"trace{i}"]
    return data


# ---- simulating ---------------------------------------------------------------------------------------


class SimRequest:
    """One request's replay: a Request the policy can read (slot, params, lengths), holding the token
    its prefill sampled, and its trace (row i: the round that starts with i + 1 output tokens)."""

    def __init__(self, spec: dict, slot: int) -> None:
        params = SamplingParams(temperature=spec["temperature"], max_tokens=spec["max_tokens"], ignore_eos=True,
                                seed=spec["seed"])
        self.req = Request(prompt_ids=[0] * spec["prompt"], params=params, slot=slot, output_ids=[0])
        self.trace = spec["trace"]

    @property
    def done(self) -> bool:
        return len(self.req.output_ids) >= self.req.params.max_tokens

    @property
    def row(self) -> np.ndarray:
        return self.trace[len(self.req.output_ids) - 1]

    def kept(self, mode: int, column: int | None) -> int:
        """Drafted tokens this round keeps: none on an AR step, the chain's run, or the tree's count."""
        return 0 if mode == AR else int(self.row[-1] if mode == CHAIN else self.row[column])

    def measured(self, columns: list[int]) -> tuple[list[int], int, bool]:
        """What a round of the tree of the last of `columns` tells the policy (by_size's result for that
        tree): the counts, and the run along its spine, cut where the spine ends before the largest
        tree's does. (Where both end together, whether the played tree's spine has the next node is
        not recorded; it is taken to, as the largest tree's does.)"""
        row = self.row
        kept, run, end = int(row[columns[-1]]), int(row[-3]), bool(row[-2])
        return [int(row[c]) for c in columns], min(kept, run), kept < run or (kept == run and end)

    def emit(self, kept: int) -> int:
        n = min(kept + 1, self.req.params.max_tokens - len(self.req.output_ids))
        self.req.output_ids.extend([0] * n)
        return n


def simulate_cell(specs: list[dict], label: str, cost: CostModel, batch: int, gradual: bool, sizes: list[int],
                  block_size: int, max_round_tokens: int = 4096, passes: int = 1) -> tuple[int, float]:
    """(tokens, seconds) of one method's rounds over the requests, `passes` times (auto keeps what it
    learned from pass to pass, as a server does): all arrive at once, or one every two rounds
    (gradual), and wait for a free slot as the engine's scheduler seats them."""
    grid = TREE_BUCKETS if cost.replays else GRID  # as the runner builds the policy, captured or eager
    policy = Policy(cost, batch, block_size, sizes[-1], max_round_tokens, grid) if label == "auto" else None
    tokens, seconds = 0, 0.0
    for _ in range(passes):
        t, s = _one_pass(specs, policy, label, cost, batch, gradual, sizes, block_size, max_round_tokens)
        tokens, seconds = tokens + t, seconds + s
    return tokens, seconds


def _one_pass(specs: list[dict], policy: Policy | None, label: str, cost: CostModel, batch: int, gradual: bool,
              sizes: list[int], block_size: int, max_round_tokens: int) -> tuple[int, float]:
    arrivals, waiting, running, free = list(specs), [], [], list(range(batch))
    tokens, seconds, rounds = 0, 0.0, 0
    while arrivals or waiting or running:
        if not gradual or rounds % 2 == 0:
            waiting += arrivals[:1] if gradual else arrivals
            arrivals = arrivals[1:] if gradual else []
        host = 0.0
        while waiting and free:
            sim = SimRequest(waiting.pop(0), free.pop())
            running.append(sim)
            if policy is not None:
                t0 = time.thread_time()
                rows = runner_module.lifetime_rows(sim.req, [r.req for r in running])
                sim.req.speculative = bool(policy.admit(sim.req.params, rows))
                host += time.thread_time() - t0
        rounds += 1
        if not running:
            continue
        R, reqs = len(running), [r.req for r in running]
        if policy is not None:
            t0 = time.thread_time()
            plan = policy.plan(reqs)
            host += time.thread_time() - t0
        else:
            method, budget = ("ddtree", int(label.split("-")[1])) if label.startswith("ddtree-") else (label, 0)
            plan = fixed_plan(R, method, block_size, min(budget, runner_module.budget_cap(max_round_tokens, R)))
        column = sizes.index(plan.budget) if plan.tree_rows else None
        kept = [r.kept(plan.modes[i], column) for i, r in enumerate(running)]
        if plan.measure:  # the policy's grid (all of the trace's sizes, or captured, the powers of two)
            columns = [sizes.index(b) for b in policy.grid[: plan.measure]]
            measured = [running[i].measured(columns) for i in plan.draft_rows]
        else:
            measured = None
        keys = max(len(r.prompt_ids) + len(r.output_ids) for r in reqs)
        cost_s = float(cost.round_seconds(R, plan.window, plan.drafting, plan.depth, plan.tree_rows, plan.budget,
                                          keys, sum(not r.params.greedy for r in reqs)))
        if policy is not None and runner_module.timed(plan, policy.rounds):
            t0 = time.thread_time()
            policy.observe(plan, [r.slot for r in reqs], kept, measured, cost_s)
            host += time.thread_time() - t0
        tokens += sum(r.emit(k) for r, k in zip(running, kept))
        seconds += cost_s + host
        for r in [r for r in running if r.done]:
            running.remove(r)
            free.append(r.req.slot)
    return tokens, seconds


def simulate(data: dict, cost: CostModel, temperatures: list[float], batches: list[int], shapes: list[str],
             per_batch: int = 2, labels: list[str] = LABELS, passes: int = 2) -> list[dict]:
    """Per (temperature, batch, shape) cell, every label's tokens a second and auto's ratios."""
    sizes, rows = data["sizes"], []
    for t in temperatures:
        pool = [r for r in data["requests"] if r["temperature"] == t]
        if not pool:
            raise SystemExit(f"policy_sim: nothing recorded at T={t}; the traces hold "
                             f"T = {sorted({r['temperature'] for r in data['requests']})}")
        for b in batches:
            n = max(8, per_batch * b)
            if len(pool) < n:
                raise SystemExit(f"policy_sim: {len(pool)} requests recorded at T={t}, the cell needs {n}; "
                                 f"record more (--requests {n})")
            for shape in shapes:
                rate = {}
                for label in labels:
                    tok, sec = simulate_cell(pool[:n], label, cost, b, shape == "gradual", sizes, data["block_size"],
                                             passes=passes)
                    rate[label] = tok / sec
                fixed = {k: v for k, v in rate.items() if k != "auto"}
                top = max(fixed, key=fixed.get)
                row = {"temperature": t, "batch": b, "shape": shape, "tok_s": rate, "best_fixed": top,
                       "auto_x_best": rate["auto"] / fixed[top], "auto_x_ar": rate["auto"] / rate["ar"]}
                rows.append(row)
                print(f"T={t} batch={b} {shape:8s} auto {rate['auto']:8.1f} | best {top} {fixed[top]:8.1f} | "
                      f"auto/best {row['auto_x_best']:.3f} auto/ar {row['auto_x_ar']:.3f}", flush=True)
    return rows


def demo_cost(drafter: str | None, max_batch: int) -> CostModel:
    """The cost model an auto engine on the demo pair measures (or loads from its cache) here."""
    eng = H.engine("auto", max_batch, None, drafter)
    return eng.runner.policy.cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="measure the traces (one thread: OMP_NUM_THREADS=1)")
    rec.add_argument("--out", required=True)
    rec.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    rec.add_argument("--requests", type=int, default=32, help="per temperature (a batch-16 cell takes 32)")
    rec.add_argument("--packages", nargs="+", default=list(H.PACKAGES))
    rec.add_argument("--drafter", default=None, help="default: the demo's DFlash2 drafter")
    sim = sub.add_parser("simulate", help="replay every method over the traces")
    sim.add_argument("--traces", required=True)
    sim.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    sim.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    sim.add_argument("--shapes", nargs="+", default=["at-once", "gradual"], choices=["at-once", "gradual"])
    sim.add_argument("--passes", type=int, default=2, help="runs of each cell's requests (auto keeps learning)")
    sim.add_argument("--drafter", default=None, help="the drafter whose cost model prices the rounds (as recorded)")
    sim.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.command == "record":
        save_traces(Path(args.out), record(args.temperatures, args.requests, tuple(args.packages), MAX_BUDGET,
                                           args.drafter))
        return
    path = Path(args.traces)
    if not path.is_file():
        raise SystemExit(f"policy_sim: no traces at {path}; record them first (policy_sim.py record --out {path})")
    try:
        data = load_traces(path)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"policy_sim: {path} is not a traces file from `policy_sim.py record` ({e})") from None
    rows = simulate(data, demo_cost(args.drafter, max(args.batches)), args.temperatures, args.batches, args.shapes,
                    passes=args.passes)
    worst = min(rows, key=lambda r: r["auto_x_best"])
    print(f"\nworst auto/best {worst['auto_x_best']:.3f} (T={worst['temperature']}, batch {worst['batch']}, "
          f"{worst['shape']}); worst auto/ar {min(r['auto_x_ar'] for r in rows):.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
