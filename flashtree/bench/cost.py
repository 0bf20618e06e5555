"""The target's verify cost as a function of tree size: the curve a budget should be chosen from.

Each point is one target forward over a random DDTree (built by build_tree from random logits,
so it has the real shape, mask and positions) written after a fresh cache view holding
`context_len` committed tokens, plus the per-node pick at each benchmarked temperature. That is
exactly the engine's "verify" stage, so T_verify(n) from here slots into the round-time model.
Each size runs `warmup` untimed forwards, then `repeats` timed ones back to back: the steady
state of a decode loop, which repeats one window size. (Round-robin over sizes was tried and
rejected: right after a 1025-node forward, a 1-node forward ran ~40% slower on the CPU, with
caches and the allocator still shaped by the big one.) Each point keeps the fastest repeat:
noise from other processes only ever adds time, and on a shared CPU it lands in bursts that can
take even the median (the median is kept too).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from flashtree.bench.metrics import interpolate
from flashtree import sampler
from flashtree.models.context import ForwardContext
from flashtree.sampling import SamplingParams
from flashtree.tree import TreeSpec, build_tree, chain_spec

DEFAULT_DEPTH = 15  # draft depth when no drafter is loaded (a 16-token DFlash block)


@dataclass
class CostPoint:
    nodes: int
    forward_ms: float  # fastest target forward
    forward_median_ms: float
    pick_ms: dict[str, float]  # fastest per-node pick, keyed by str(temperature)

    def verify_ms(self, temperature: float) -> float:
        return self.forward_ms + self.pick_ms.get(str(float(temperature)), 0.0)


@dataclass
class CostCurve:
    context_len: int
    repeats: int
    depth: int
    tree: list[CostPoint] = field(default_factory=list)  # DDTree shapes; n = 1 is the lone root
    chain: list[CostPoint] = field(default_factory=list)  # causal chains (ar at 1, dflash at L)

    def verify_ms(self, method: str, nodes: int, temperature: float = 0.0) -> float:
        """T_verify for a method's window: chains for ar/dflash/mtp, trees for ddtree (interpolated).

        A lone root is the same window in both lists, so n = 1 takes the faster of the two.
        """
        if nodes == 1:
            ones = [p.verify_ms(temperature) for p in self.tree + self.chain if p.nodes == 1]
            if ones:
                return min(ones)
        points = self.chain if method in ("ar", "dflash", "mtp") and self.chain else self.tree
        return interpolate([(p.nodes, p.verify_ms(temperature)) for p in points], nodes)

    def as_dict(self) -> dict:
        def rows(points: list[CostPoint]) -> list[dict]:
            return [vars(p) for p in points]

        return {"context_len": self.context_len, "repeats": self.repeats, "depth": self.depth,
                "tree": rows(self.tree), "chain": rows(self.chain)}


def curve_sizes(max_nodes: int, budgets: list[int], dense: bool = True) -> list[int]:
    """1 .. max_nodes: powers of two (and 1.5x between them when dense), plus every budget + 1."""
    sizes = {1, max_nodes}
    n = 1
    while n <= max_nodes:
        sizes.add(n)
        if dense and n >= 2 and n * 3 // 2 <= max_nodes:
            sizes.add(n * 3 // 2)
        n *= 2
    sizes.update(b + 1 for b in budgets if b + 1 <= max_nodes)
    return sorted(sizes)


def random_tree(nodes: int, depth: int, vocab: int, device: torch.device, gen: torch.Generator) -> TreeSpec:
    """A DDTree of exactly `nodes` nodes from peaked random draft logits (a lone root for 1)."""
    root = torch.randint(vocab, (1,), generator=gen).to(device)
    if nodes == 1:
        return chain_spec(root[:, None])
    logits = (4.0 * torch.randn(1, depth, vocab, generator=gen)).to(device)
    return build_tree(root, logits, nodes - 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_cost_curve(target, drafter, tree_sizes: list[int], chain_sizes: list[int], context_len: int,
                       temperatures: list[float], repeats: int = 5, warmup: int = 2,
                       progress: Callable[[], None] | None = None) -> CostCurve:
    """Time the verify stage at every size; `progress` is called once per timed forward."""
    device = target.embed_tokens.weight.device
    vocab = target.vocab_size
    depth = drafter.block_size - 1 if drafter is not None else DEFAULT_DEPTH
    features = tuple(drafter.args.target_layer_ids) if drafter is not None else ()
    gen = torch.Generator().manual_seed(0)
    # Small windows first: the largest ones leave the CPU's caches and allocator shaped for
    # themselves, which slowed the next small window for a while.
    specs = [("chain", n, chain_spec(torch.randint(vocab, (1, n), generator=gen).to(device))) for n in chain_sizes]
    specs += [("tree", n, random_tree(n, depth, vocab, device, gen)) for n in tree_sizes]
    cache = target.new_cache(1, context_len + max(s.num_nodes for *_, s in specs))
    cache.k.normal_()
    cache.v.normal_()
    cache.set_length(0, context_len)
    params = {str(float(t)): SamplingParams(temperature=float(t), seed=0) for t in temperatures}
    fwd: dict[int, list[float]] = {i: [] for i in range(len(specs))}
    pick: dict[int, dict[str, list[float]]] = {i: {k: [] for k in params} for i in range(len(specs))}
    for i, (_, _, spec) in enumerate(specs):
        for rep in range(warmup + repeats):
            ctx = ForwardContext.verify(cache, [0], spec)
            _sync(device)
            t0 = time.perf_counter()
            out = target(spec.tokens.clamp(min=0), ctx, features)
            _sync(device)
            t1 = time.perf_counter()
            picked = {}
            for k, p in params.items():
                s0 = time.perf_counter()
                sampler.pick(out.logits, sampler.SamplingBatch.build([p], [0], device), ctx.positions + 1, spec.depth_bound + 1)
                _sync(device)
                picked[k] = time.perf_counter() - s0
            if rep >= warmup:
                fwd[i].append(t1 - t0)
                for k, v in picked.items():
                    pick[i][k].append(v)
                if progress is not None:
                    progress()
    curve = CostCurve(context_len, repeats, depth)
    for i, (kind, n, _) in enumerate(specs):
        point = CostPoint(n, 1e3 * min(fwd[i]), 1e3 * statistics.median(fwd[i]),
                          {k: 1e3 * min(v) for k, v in pick[i].items()})
        getattr(curve, kind).append(point)
    return curve
