"""Captured rounds: a round at fixed shapes, replayed through static buffers.

As nano-vllm does for decoding, every shape a round can take is captured before the first request:
one `CapturedRound` per (batch bucket, key bucket, plan), all sharing one memory pool. A fixed
method has one plan; budget="auto" has one per arm it may play (AR steps, the chain, each tree
size), every row drafting, with a static per-row flag that turns the drafts of rows the policy
keeps on AR steps into padding. A round is two captured pieces with the sampler between them,
whose code path depends on how the batch samples (greedy, temperature, top-k/top-p), which a
graph cannot branch on:

1. forward: the drafter's block, the tree (or chain), the target's verify -> logits and features;
2. commit: the accept walk, the KV compaction and the drafter's context append.

The runner writes its inputs (slots, starts, roots, picks) into the static buffers and reads the
declared outputs (logits, accepted counts, tokens, path) from static buffers that every replay
overwrites, shared by the rounds of a batch bucket: what must outlive a round is copied out by
the round's one host read. On CUDA each piece is a torch.cuda.CUDAGraph; on the CPU the same
pieces run eagerly through the same buffers, so the CPU tests exercise the same discipline.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch
from torch import Tensor
from tqdm import tqdm

from flashtree.engine.cost_model import Timer
from flashtree.engine.shapes import key_bucket
from flashtree.models.context import SlotBatch


class Piece:
    """One captured function of the static buffers. Of its result, the tensors named in `shared`
    (a dict the pieces of one batch bucket share, filled by the first capture) are copied into
    static buffers at every replay, on both devices, so rounds of every key bucket hold one copy
    of the big outputs (the logits) between them; the rest of the result is the replay's own
    (CUDA: the graph's, rewritten in place by each replay)."""

    def __init__(self, fn: Callable[[], dict], pool, cuda: bool, shared: dict[str, Tensor], names: tuple[str, ...]
                 ) -> None:
        self.fn, self.shared, self.names = fn, shared, names
        self.graph = None
        if cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._static(fn())  # warm-up outside the graph: lazy inits and autotuning stay out of it
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.result = self._static(fn())
        else:
            self.result = self._static(fn())

    def _static(self, result: dict) -> dict:
        """The result with its named tensors copied into the shared static buffers."""
        for name in self.names:
            if name not in self.shared:
                self.shared[name] = torch.empty_like(result[name])
            self.shared[name].copy_(result[name])
        return {**result, **{name: self.shared[name] for name in self.names}}

    def replay(self) -> dict:
        if self.graph is not None:
            self.graph.replay()
            return self.result
        return self._static(self.fn())


class CapturedRound:
    """Static inputs and the two pieces of one (batch bucket, key bucket, plan) round."""

    def __init__(self, runner, rows: int, key_len: int, arm: int | None, dummy: int, pool, cuda: bool,
                 shared: dict) -> None:
        device = runner.device
        self.rows, self.key_len = rows, key_len
        self.slots = torch.full((rows,), dummy, dtype=torch.long, device=device)
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)
        self.roots = torch.zeros(rows, dtype=torch.long, device=device)
        self.drafting = torch.ones(rows, dtype=torch.bool, device=device)  # auto: rows whose drafts count
        self.cuda = cuda
        self.batch = batch = SlotBatch.captured(self.slots, self.starts)
        plan = runner.captured_plan(arm, rows)
        self.forward = Piece(lambda: runner.captured_forward(batch, self.roots, key_len, plan, self.drafting), pool,
                             cuda, shared.setdefault("forward", {}), ("logits", "positions"))
        n = self.forward.result["logits"].shape[1]
        self.picks = torch.zeros(rows, n, dtype=torch.long, device=device)
        # The commit reads the forward's state: on CUDA the captured one, whose tensors every
        # replay rewrites in place; on the CPU the latest replay's.
        self._state = self.forward.result
        state = (lambda: self.forward.result) if cuda else (lambda: self._state)
        self.commit = Piece(lambda: runner.captured_commit(state(), self.picks, key_len, plan), pool, cuda,
                            shared.setdefault("commit", {}),
                            ("num_nodes", "tokens", "path") + (("codes",) if plan.measure else ()))

    def run_forward(self, slots: Tensor, starts: Tensor, roots: Tensor, first: int | None = None,
                    drafting: Tensor | None = None) -> dict:
        """Replay the forward on these inputs (device tensors of `rows` entries). `first`: the
        slots are first..first+rows-1; an eager (CPU) replay then reads the cache through a view
        where a graph, whose code path is fixed, always gathers."""
        if not self.cuda:
            self.batch.first = first
        self.slots.copy_(slots)
        self.starts.copy_(starts)
        self.roots.copy_(roots)
        if drafting is not None:
            self.drafting.copy_(drafting)
        self._state = self.forward.replay()
        return self._state

    def run_commit(self, picks: Tensor) -> dict:
        self.picks.copy_(picks)
        return self.commit.replay()


class RoundGraphs:
    """Every CapturedRound an engine can meet: batch buckets x key buckets x the plans (arms) a
    batch bucket may play (runner.captured_arms)."""

    @torch.inference_mode()  # like every round: no autograd state, and the buffers are inference tensors
    def __init__(self, runner, batch_buckets: list[int], key_buckets: list[int], dummy: int,
                 progress: bool = True) -> None:
        cuda = runner.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        self.rounds: dict[tuple[int, int, int | None], CapturedRound] = {}
        t0 = time.perf_counter()
        # Largest first, so later captures reuse the pool's blocks (as nano-vllm does).
        shapes = [(b, k, arm) for b in sorted(batch_buckets, reverse=True) for arm in runner.captured_arms(b)
                  for k in sorted(key_buckets, reverse=True)]
        shared: dict[tuple, dict] = {}  # per batch bucket and plan: the static outputs all its key buckets write
        for b, k, arm in tqdm(shapes, desc="capturing rounds", unit="shape", file=sys.stderr, disable=not progress):
            outputs = shared.setdefault((b, arm), {})
            self.rounds[b, k, arm] = CapturedRound(runner, b, k, arm, dummy, pool, cuda, outputs)
        self.seconds = time.perf_counter() - t0

    def get(self, rows: int, key_len: int, arm: int | None = None) -> CapturedRound:
        return self.rounds[rows, key_len, arm]

    @torch.inference_mode()
    def timed(self, runner, start: int, dummy: int) -> dict[tuple[int, int, bool], float]:
        """Seconds of each captured plan's replay, forward and commit, per batch bucket: every row on the
        dummy slot `start` keys deep (best of two after one), keyed (rows, window, tree) as CostModel.replays.
        budget="auto" prices its plans with them: on a GPU the eager timings it starts from are the host's."""
        timer = Timer(runner.device, float("inf"))
        out: dict[tuple[int, int, bool], float] = {}
        for (b, k, arm), captured in self.rounds.items():
            plan = runner.captured_plan(arm, b)
            if k != key_bucket(start + plan.window, runner.cache.max_len) or (b, plan.window, plan.budget > 0) in out:
                continue
            slots = torch.full((b,), dummy, dtype=torch.long, device=runner.device)
            starts, zeros = torch.full_like(slots, start), torch.zeros_like(slots)

            def replay(captured=captured, slots=slots, starts=starts, zeros=zeros) -> None:
                state = captured.run_forward(slots, starts, zeros, None, zeros == 0)
                captured.run_commit(torch.zeros_like(state["positions"]))

            out[b, plan.window, plan.budget > 0] = timer(replay)
        return out
