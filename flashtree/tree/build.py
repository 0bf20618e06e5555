"""Exact top-B prefix trees (DDTree) and chains (DFlash) from the drafter's per-depth logits.

Tie rule, used by every function here: a prefix ranks higher when its score (sum of float32
log-probs, added root to leaf) is higher; on equal score the shallower prefix wins; then the one
with the lower rank in its level. Level d is ordered by (score, parent's rank in level d-1,
token's rank at depth d), and tokens at a depth are ranked by (log-prob desc, token id asc).
A child never beats its parent (same or lower score, deeper), so every top-b set is prefix-closed.
Prefixes with score -inf (a token of probability zero) are never drafted.
"""
import functools
import heapq

import numpy as np
import torch
from torch import Tensor

from flashtree.tree.spec import TreeSpec, chain_spec


def _topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k of log-probs x (all <= 0) along the last dim, ordered by (value desc, index asc).

    torch.topk leaves the order of equal values unspecified, so select on an exact int64 key:
    with the sign bit forced on (harmless for x <= 0, and it folds +0.0 into -0.0), a float's bits
    read as a signed int grow as the value falls, so the smallest bits * 2^32 + index wins.
    """
    bits = torch.copysign(x, -1.0).view(torch.int32).to(torch.int64)
    key = torch.add(torch.arange(x.shape[-1], device=x.device), bits, alpha=1 << 32)
    idx = key.topk(k, dim=-1, largest=False).indices
    return x.gather(-1, idx), idx


@functools.lru_cache(maxsize=64)
def _pairs(width: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(parent rank p, token rank t) candidates that can still reach a level's top-`width`.

    Every (p', t') with p' <= p, t' <= t scores at least as high and comes first in the tie
    order, so (p, t) needs (p+1)(t+1) <= width: about width*ln(width) pairs instead of width*k.
    Listed p-major, so list position follows the level's tie order.
    """
    p = torch.arange(width)
    counts = torch.clamp(width // (p + 1), max=k)
    starts = torch.cumsum(counts, 0) - counts
    parent = torch.repeat_interleave(p, counts)
    token = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
    return parent.to(device), token.to(device)


def build_tree(root_tokens: Tensor, draft_logits: Tensor, budget: int | Tensor) -> TreeSpec:
    """The top-budget[r] prefixes (lengths 1..D) of each row's factorised draft distribution.

    root_tokens [R], draft_logits [R, D, V], budget: drafted nodes per row (root excluded), int or [R].
    Built depth by depth: level d is the top-B of (level d-1 x top-min(B, V) tokens at depth d),
    which is exact because every member of a level has its parent in the previous one; the tree is
    the top-budget of the union of levels. Output: root, then nodes by (depth, rank in level),
    N = 1 + max budget, short rows padded. Only a tensor budget costs a host sync (its max).
    """
    R, D, V = draft_logits.shape
    dev = draft_logits.device
    bmax = int(budget.max()) if isinstance(budget, Tensor) else budget
    K = min(bmax, V)
    lp = torch.log_softmax(draft_logits.float(), dim=-1)
    tok_lp, tok_id = _topk(lp, K)  # [R, D, K]
    pair_p, pair_t = _pairs(bmax, K, dev)

    pair_lp = tok_lp[:, :, pair_t]  # [R, D, C]
    score = torch.full((R, bmax), float("-inf"), device=dev)  # level 0: the root alone
    score[:, 0] = 0.0
    scores, picked = [], []
    # On the CPU reading scalars is free, so stop at the first depth that cannot place a node.
    prune = dev.type == "cpu"
    best_next = tok_lp[:, :, 0].tolist() if prune else None
    floor = [float("-inf")] * R  # per row: the worst score among the best bmax found so far
    for d in range(D):
        score, sel = _topk(score[:, pair_p] + pair_lp[:, d], bmax)
        scores.append(score)
        picked.append(sel)
        if prune and d + 1 < D:
            # Any deeper prefix scores at most (best at this level + best token at the next depth);
            # once that is below bmax found prefixes in every row, no deeper node can be chosen.
            top, last = score[:, 0].tolist(), score[:, -1].tolist()
            floor = [max(f, x) for f, x in zip(floor, last)]
            if all(t + b[d + 1] < f for t, b, f in zip(top, best_next, floor)):
                break
    D = len(scores)
    picked = torch.stack(picked, 1)  # [R, D, B] positions in the pair list
    scores = torch.stack(scores, 1).flatten(1)  # [R, D*B]; flat index d*B + rank follows the tie order
    parent_rank = pair_p[picked].flatten(1)
    token = tok_id.gather(2, pair_t[picked]).flatten(1)

    top_score, top = _topk(scores, bmax)
    rank = torch.arange(bmax, device=dev)
    chosen = (rank < torch.as_tensor(budget, device=dev).reshape(-1, 1)) & (top_score > float("-inf"))
    order = torch.where(chosen, top, D * bmax).sort(dim=1).values  # by (depth, level rank); padding last
    keep = order < D * bmax
    flat = order.clamp(max=D * bmax - 1)
    depth = flat // bmax + 1

    # Parents: flat index of the parent in the previous level -> its output slot (root = 0).
    slot = torch.zeros(R, D * bmax + 1, dtype=torch.int64, device=dev)
    slot.scatter_(1, order, rank.expand(R, bmax) + 1)
    parent_flat = (depth - 2) * bmax + parent_rank.gather(1, flat)
    parent = torch.where(depth > 1, slot.gather(1, parent_flat.clamp(min=0)), 0)

    root = root_tokens.to(torch.int64).reshape(R, 1)
    return TreeSpec(
        tokens=torch.cat([root, torch.where(keep, token.gather(1, flat), -1)], 1),
        parents=torch.cat([torch.full_like(root, -1), parent.masked_fill(~keep, 0)], 1),
        depths=torch.cat([torch.zeros_like(root), depth.masked_fill(~keep, 1)], 1),
        sizes=1 + keep.sum(1),
        max_depth=min(D, bmax),
        scores=torch.cat([torch.zeros_like(root, dtype=scores.dtype),
                          torch.where(keep, scores.gather(1, flat), float("-inf"))], 1),
    )


def build_chain(root_tokens: Tensor, draft_logits: Tensor) -> TreeSpec:
    """DFlash: the argmax token at every depth (ties to the lower id), as a chain."""
    R = draft_logits.shape[0]
    tokens = torch.cat([root_tokens.to(torch.int64).reshape(R, 1), draft_logits.argmax(-1)], 1)
    return chain_spec(tokens)


def build_tree_reference(root_token: int, draft_logits: Tensor, budget: int) -> list[tuple[int, ...]]:
    """Best-first search with a heap over prefixes: the test oracle for build_tree.

    Pops prefixes in the tie order and pushes all children of each popped one. A parent is popped
    before its children, so its rank in its level (pops so far at its depth) is known by then.
    Returns the drafted token tuples (root excluded) in pop order.
    """
    del root_token  # the root is fixed; it does not enter any score
    lp = torch.log_softmax(draft_logits.float(), dim=-1).cpu().numpy()
    D, V = lp.shape
    order = [sorted(range(V), key=lambda v: (-lp[d, v], v)) for d in range(D)]  # (log-prob desc, id asc)
    tok_rank = [{v: i for i, v in enumerate(o)} for o in order]
    heap: list = []

    def push_children(prefix: tuple[int, ...], score: np.float32, level_rank: int) -> None:
        d = len(prefix)
        if d == D:
            return
        for v in range(V):
            s = np.float32(score + lp[d, v])
            if s > -np.inf:
                heapq.heappush(heap, (-float(s), d + 1, level_rank, tok_rank[d][v], prefix + (v,), s))

    push_children((), np.float32(0.0), 0)
    popped_at_depth = [0] * (D + 1)
    out = []
    while heap and len(out) < budget:
        *_, prefix, score = heapq.heappop(heap)
        out.append(prefix)
        push_children(prefix, score, popped_at_depth[len(prefix)])
        popped_at_depth[len(prefix)] += 1
    return out
