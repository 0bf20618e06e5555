"""build_tree's tree computed with numpy, for logits on the CPU.

On the CPU a tensor build is some 300 small ops whose dispatch costs more than their arithmetic,
and torch.topk passes over the vocabulary more slowly than a bound from group maxima plus one
compare, so build_tree sends CPU logits here whenever it may read them on the host (prune).
It follows build.py's tie rule and returns the same TreeSpec bit for bit (tests/test_tree_host.py
checks the two on tie-heavy random inputs); the log-probs still come from torch.log_softmax, the
one step numpy could round differently.
"""
from __future__ import annotations

import functools
import heapq

import numpy as np
import torch
from torch import Tensor

from flashtree.tree.spec import TreeSpec


@functools.lru_cache(maxsize=64)
def pair_list(width: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(parent rank p, token rank t) candidates that can still reach a level's top-`width`.

    Every (p', t') with p' <= p, t' <= t scores at least as high and comes first in the tie
    order, so (p, t) needs (p+1)(t+1) <= width: about width*ln(width) pairs instead of width*k.
    Listed p-major, so list position follows the level's tie order. Read-only (cached).
    """
    counts = np.minimum(width // np.arange(1, width + 1), k)
    parent = np.repeat(np.arange(width), counts)
    token = np.arange(parent.size) - np.repeat(np.cumsum(counts) - counts, counts)
    parent.flags.writeable = token.flags.writeable = False
    return parent, token


def levels_needed(top: np.ndarray, width: int) -> int:
    """How many depths can hold a node of any row's top-`width` tree, given top [R, D, K]: each
    (row, depth)'s best K token log-probs, descending.

    The best prefix of each length is the chain of top tokens (float32 rounding is monotone), and
    a deeper prefix never beats it, so chain[d+1] bounds every prefix longer than d+1. The `width`
    prefixes "chain of length e, then one of the K = width best tokens at depth e+1" are distinct
    and scored exactly as the builder scores them; the worst of them is chain[e] + the K-th token.
    Once chain[d+1] is below the best such floor over e <= d in every row, at least `width`
    shallower prefixes outrank every deeper one (ties go to the shallower), so levels past d+1
    cannot change the tree.
    """
    R, D, K = top.shape
    if K < width:  # fewer than `width` tokens per depth: no cheap floor
        return D
    chain = np.add.accumulate(top[:, :, 0], axis=1, dtype=np.float32)  # sequential, in the builder's order
    parent = np.concatenate([np.zeros((R, 1), np.float32), chain[:, :-1]], 1)
    floor = np.maximum.accumulate(parent + top[:, :, -1], axis=1)
    done = (chain[:, 1:] < floor[:, :-1]).all(0)  # [D-1]: nothing past depth d+1 can be placed
    return int(done.argmax()) + 1 if done.any() else D


GROUPS_PER_K = 4  # strided groups per wanted token: fewer leave more candidates, more cost a bigger partition
MIN_GROUPS = 256  # the group count for small k, where GROUPS_PER_K * k groups would be too few to pay


def _floor(lp: np.ndarray, k: int) -> np.ndarray:
    """A lower bound [F] on the k-th largest value of each row of lp [F, V].

    From W strided groups (group j: entries j, j + W, j + 2W, ... of the row, which numpy reduces
    fastest): k groups have a maximum >= the k-th largest group maximum, so k distinct entries do.
    Rows too short for W groups take their exact k-th value from a partition of the whole row.
    """
    F, V = lp.shape
    W = max(MIN_GROUPS, GROUPS_PER_K * k)
    if 2 * W > V:
        return np.partition(lp, V - k, axis=1)[:, V - k]
    peaks = lp[:, : V // W * W].reshape(F, V // W, W).max(1)
    return np.partition(peaks, W - k, axis=1)[:, W - k]


def token_topk(lp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of log-probs lp [F, V] per row by (value desc, id asc): values and ids [F, k].

    Every entry at or above the k-th largest value, ties included, is at or above _floor's bound,
    so sorting just those candidates by (row, value desc, id) is exact. They are usually a few
    more than k, where torch.topk or a partition would pass over the whole row again.
    """
    F, V = lp.shape
    flat = np.flatnonzero(lp >= _floor(lp, k)[:, None])
    row = flat // V
    vals = lp.reshape(-1)[flat]
    order = np.lexsort((flat, -vals, row))
    counts = np.bincount(row, minlength=F)
    pick = order[(np.cumsum(counts) - counts)[:, None] + np.arange(k)]
    return vals[pick], flat[pick] - V * np.arange(F)[:, None]


def _best_first(x: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest entries of each row of x (all <= 0), ties to the lower position.

    -x folds +0.0 and -0.0 together, as build.py's integer keys do.
    """
    return np.argsort(-x, axis=1, kind="stable")[:, :k]


def _at(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    """x[r, index[r, j]] for 2-d x and index: take_along_axis without its per-call checks."""
    return x[np.arange(x.shape[0])[:, None], index]


def build_levels(tok_lp: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each level's top-`width` prefixes from tok_lp [R, D, K] (sorted token log-probs per depth).

    Level d is the top-`width` of (level d-1 x the pair list's token ranks), taken in the pair
    list's tie order. Returns the scores [R, D*width] (level d's rank-i entry at d*width + i) and
    each entry's position in the pair list [R, D, width]. The loop adds negated log-probs, which
    rounds to the negated sums exactly, so an ascending stable argsort needs no negation per level.
    """
    R, D, K = tok_lp.shape
    pair_p, pair_t = pair_list(width, K)
    cost = -tok_lp[:, :, pair_t]  # [R, D, C]
    rows = np.arange(R)[:, None]
    level = np.full((R, width), np.inf, np.float32)  # level 0: the root alone
    level[:, 0] = -0.0  # negates to +0.0, as the root's score is
    costs = np.empty((R, D, width), np.float32)
    picked = np.empty((R, D, width), np.int64)
    for d in range(D):
        cand = level[:, pair_p] + cost[:, d]
        picked[:, d] = sel = np.argsort(cand, axis=1, kind="stable")[:, :width]
        costs[:, d] = level = cand[rows, sel]
    return -costs.reshape(R, D * width), picked


def build_tree_host(root_tokens: Tensor, draft_logits: Tensor, budget: int | Tensor, width: int) -> TreeSpec:
    """build_tree(root_tokens, draft_logits, budget, max_budget=width, prune=True) for CPU tensors.

    `width` is build_tree's checked bound on the budget (its bmax).
    """
    R, D, V = draft_logits.shape
    K = min(width, V)
    lp = torch.log_softmax(draft_logits.detach().float(), dim=-1).numpy()
    tok_lp, tok_id = token_topk(lp.reshape(R * D, V), K)
    tok_lp, tok_id = tok_lp.reshape(R, D, K), tok_id.reshape(R, D, K)
    D = levels_needed(tok_lp, width)
    if R == 1 and not isinstance(budget, Tensor) and budget >= width:
        spec = best_first_one(int(root_tokens.reshape(-1)[0]), tok_lp[0, :D], tok_id[0], width)
        if spec is not None:
            return spec
    scores, picked = build_levels(tok_lp[:, :D], width)
    pair_p, pair_t = pair_list(width, K)
    sibling = pair_t[picked]  # [R, D, width]
    token = tok_id[np.arange(R)[:, None, None], np.arange(D)[:, None], sibling]
    top = _best_first(scores, width)
    return assemble_host(root_tokens, scores, pair_p[picked].reshape(R, -1), token.reshape(R, -1),
                         _at(scores, top), top, budget, width, sibling.reshape(R, -1))


def best_first_one(root: int, tok_lp: np.ndarray, tok_id: np.ndarray, width: int) -> TreeSpec | None:
    """One row's tree of exactly `width` nodes, popped best first from a heap; None when fewer than
    `width` nodes have a finite score (build_levels then pads the row).

    A row of a few dozen nodes pops them in ~100 us of Python where the level build costs a numpy
    pass per level. It is the level build's tree bit for bit: the heap's order (cost, depth, parent's
    level rank, token rank) is the union order the level build takes its top-`width` in, a parent
    always pops before its children, so the nodes popped at one depth are the first of that level,
    in level order; scores are the same float32 sums (tok_lp [D, K] sorted per depth, tok_id [D, K]).
    """
    D, K = tok_lp.shape
    cost = (-tok_lp).tolist()  # float32 values, held exactly by Python floats
    f32 = np.float32
    # (cost, depth, parent's level rank, token rank, parent's cost); the root's cost is -0.0, as in build_levels
    heap = [(cost[0][0], 1, 0, 0, -0.0)]
    popped = [0] * (D + 1)  # nodes popped per depth: the next one's level rank
    nodes = []  # in pop order: (depth, level rank, parent's level rank, token rank, cost)
    while heap and len(nodes) < width:
        c, d, p, t, pc = heapq.heappop(heap)
        if c == float("inf"):
            return None
        nodes.append((d, popped[d], p, t, c))
        if d < D:
            heapq.heappush(heap, (float(f32(c) + f32(cost[d][0])), d + 1, popped[d], 0, c))
        popped[d] += 1
        if t + 1 < K:
            heapq.heappush(heap, (float(f32(pc) + f32(cost[d - 1][t + 1])), d, p, t + 1, pc))
    if len(nodes) < width:
        return None
    slot = {}  # (depth, level rank) -> output slot
    out = np.zeros((6, 1 + width), np.float64)  # tokens, parents, depths, scores, ranks, first
    out[:, 0] = (root, -1, 0, 0.0, 0, 1)
    for s, i in enumerate(sorted(range(width), key=lambda i: nodes[i][:2]), 1):
        d, r, p, t, c = nodes[i]
        slot[d, r] = s
        out[:, s] = (tok_id[d - 1, t], slot[d - 1, p] if d > 1 else 0, d, -c, i + 1, t == 0)
    ints = torch.from_numpy(out[[0, 1, 2, 4]].astype(np.int64)[:, None])
    return TreeSpec(tokens=ints[0], parents=ints[1], depths=ints[2], sizes=torch.tensor([1 + width]),
                    max_depth=min(D, width), scores=torch.from_numpy(out[3:4].astype(np.float32)),
                    ranks=ints[3], first=torch.from_numpy(out[5:6] > 0))


def assemble_host(root_tokens: Tensor, scores: np.ndarray, parent_rank: np.ndarray, token: np.ndarray,
                  top_score: np.ndarray, top: np.ndarray, budget: int | Tensor, bmax: int,
                  sibling: np.ndarray) -> TreeSpec:
    """build.assemble on numpy arrays: the TreeSpec of the top-budget nodes, by (depth, level rank).

    The sort that orders the chosen nodes stays torch's: its padding keys tie, and the padding
    nodes' ranks are whatever torch's unstable sort gives them.
    """
    R, flat_len = scores.shape
    D = flat_len // bmax
    rank = np.arange(bmax)
    if isinstance(budget, Tensor):
        budget = budget.cpu().numpy().reshape(-1, 1)
    chosen = (rank < budget) & (top_score > -np.inf)
    order, place = torch.from_numpy(np.where(chosen, top, D * bmax)).sort(dim=1)
    order, place = order.numpy(), place.numpy()
    keep = order < D * bmax
    flat = np.minimum(order, D * bmax - 1)
    depth = flat // bmax + 1

    # Parents: flat index of the parent in the previous level -> its output slot (root = 0).
    rows = np.arange(R)[:, None]
    slot = np.zeros((R, D * bmax + 1), np.int64)
    slot[rows, order] = rank + 1
    parent_flat = (depth - 2) * bmax + parent_rank[rows, flat]
    parent = np.where(depth > 1, slot[rows, np.maximum(parent_flat, 0)], 0)

    roots = root_tokens.reshape(R, 1).cpu().numpy()
    return TreeSpec(
        tokens=_after(roots, np.where(keep, token[rows, flat], -1), np.int64),
        parents=_after(-1, np.where(keep, parent, 0), np.int64),
        depths=_after(0, np.where(keep, depth, 1), np.int64),
        sizes=torch.from_numpy(1 + np.count_nonzero(keep, 1).astype(np.int64)),
        max_depth=min(D, bmax),
        scores=_after(0.0, np.where(keep, scores[rows, flat], -np.inf), np.float32),
        ranks=_after(0, place + 1, np.int64),
        first=_after(True, sibling[rows, flat] == 0, bool),
    )


def _after(root: np.ndarray | float | bool, nodes: np.ndarray, dtype: type) -> Tensor:
    """[root | nodes] as an [R, 1 + N] tensor of `dtype`: the root's column, then the drafted nodes'."""
    out = np.empty((nodes.shape[0], 1 + nodes.shape[1]), dtype)
    out[:, :1] = root
    out[:, 1:] = nodes
    return torch.from_numpy(out)
