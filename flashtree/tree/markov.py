"""Exact top-B prefix trees (and the greedy chain) under a Markov draft, such as DFlash2's selector.

A Markov draft gives, per depth d = 1..D, K candidate tokens cand[d, c] and conditional
log-probs trans[d, p, c] = log q_d(candidate c | the parent is candidate p of depth d-1), all
<= 0; at depth 1 the parent is the root and row p = 0 is read. A prefix is a path of candidate
indices and scores the float32 sum of its conditional log-probs, added root to leaf.

Tie rule. Level d (all prefixes of length d) is ordered by (score desc, parent's rank in level
d-1, child's candidate index asc); prefixes globally by (score desc, depth asc, level rank asc).
The child's candidate index is its rank among its siblings on equal score, so when trans does not
depend on the parent and candidates come in (log-prob desc, token id asc) order this is exactly
build_tree's rule. A child never beats its parent (score no higher, deeper), so every top-b set
T is prefix-closed. Prefixes scoring -inf are never drafted.

Why depth by depth stays exact. Let C_d = the top-B, in level order, of the children of C_{d-1}
(C_0 = the root). Under a marginal draft every member of the true level-d top-B has its parent in
the level-(d-1) top-B; under a Markov draft that fails: a weak parent can have a strong child,
since token ranks depend on the parent. What holds instead: if x in T sits at depth d, its parent
y is in T (prefix-closed), so by induction y in C_{d-1}; and fewer than B prefixes of depth d
precede x (they would all precede it globally), so fewer than B children of C_{d-1} do, and
x in C_d. C_d's order is the level order restricted to it, so T = the top-B of C_1 u .. u C_D
under the global order. Levels may hold non-members; they are harmless.

Pruning. Child t (0-based rank among its siblings by (trans desc, candidate index asc)) of the
parent at rank i of C_{d-1} is preceded globally by its t better siblings, by that parent and the
i members of C_{d-1} before it (scores at least the parent's, so at least the child's, and
shallower), and by the parent's d-2 ancestors: if i + t > B - d it is not in T. So depth d reads
the pairs (i, t) with t < min(B, K) and i + t <= B - d, listed i-major, t-minor (which is level
order on equal score). On the CPU, the build stops at the first depth that cannot place a node.
"""
import functools

import torch
from torch import Tensor

from flashtree.tree.build import assemble
from flashtree.tree.spec import TreeSpec, chain_spec


def _top(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k along the last dim by (value desc, index asc), padded with -inf past the width."""
    if x.shape[-1] < k:
        x = torch.cat([x, x.new_full((*x.shape[:-1], k - x.shape[-1]), float("-inf"))], -1)
    vals, idx = x.sort(dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


@functools.lru_cache(maxsize=256)
def _pairs(width: int, k: int, depth: int, parents: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(parent rank i, child rank t) with i < parents, t < k and i + t <= width - depth, i-major."""
    i = torch.arange(max(1, min(parents, width - depth + 1)))
    counts = torch.clamp(width - depth + 1 - i, min=1, max=k)
    starts = torch.cumsum(counts, 0) - counts
    parent = torch.repeat_interleave(i, counts)
    child = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
    return parent.to(device), child.to(device)


def build_markov_tree(root_tokens: Tensor, cand_tokens: Tensor, trans_logp: Tensor, budget: int | Tensor, *,
                      max_budget: int | None = None, prune: bool | None = None) -> TreeSpec:
    """The top-budget[r] prefixes of each row's Markov draft, as a TreeSpec like build_tree's.

    root_tokens [R]; cand_tokens [R, D, K] distinct tokens per depth; trans_logp [R, D, P, K] with
    P = K (row p: the parent is candidate p of the previous depth; depth 1 reads row 0) or P = 1
    (no dependence on the parent); budget: drafted nodes per row, int or [R]. `max_budget` bounds
    a tensor budget without reading it (no host sync). `prune` (default: on the CPU only) reads
    scores on the host to stop at the first depth that cannot place a node; off, the build makes
    no host read. Output: root, then nodes by (depth, rank in level), N = 1 + max budget, short
    rows padded.
    """
    R, D, K = cand_tokens.shape
    dev = cand_tokens.device
    bmax = max_budget if max_budget is not None else (int(budget.max()) if isinstance(budget, Tensor) else budget)
    kc = min(bmax, K)
    trans = trans_logp.float()
    P = trans.shape[2]
    child_lp, child_idx = _top(trans, kc)  # [R, D, P, kc]: each parent's children by sibling rank
    score = torch.full((R, bmax), float("-inf"), device=dev)  # level 0: the root alone
    score[:, 0] = 0.0
    cand_of = torch.zeros(R, bmax, dtype=torch.int64, device=dev)  # each level member's candidate index
    scores, parent_ranks, cands, siblings = [], [], [], []
    prune = dev.type == "cpu" if prune is None else prune
    best_next = trans.flatten(2).amax(-1).tolist() if prune else None
    floor = [float("-inf")] * R  # per row: the worst score among the best bmax found so far
    members = 1  # a bound on the real members of the previous level
    for d in range(min(D, bmax)):  # a member of T at depth d has d-1 ancestors in T: d <= bmax
        pi, pt = _pairs(bmax, kc, d + 1, members, dev)
        members = min(bmax, members * kc)
        row = cand_of[:, pi] if (d > 0 and P > 1) else torch.zeros_like(pi).expand(R, -1)
        flat = row * kc + pt  # index into this depth's [P * kc] children table
        lp = child_lp[:, d].flatten(1).gather(1, flat)
        score, sel = _top(score[:, pi] + lp, bmax)
        sel = sel.clamp(max=len(pi) - 1)  # -inf padding past the pair list: any valid index
        cand_of = child_idx[:, d].flatten(1).gather(1, flat).gather(1, sel)
        scores.append(score)
        parent_ranks.append(pi[sel])
        siblings.append(pt[sel])
        cands.append(cand_of)
        if prune and d + 1 < min(D, bmax):
            # A member of T one level deeper extends a member of C_d: it scores at most
            # (best of C_d + best conditional at the next depth).
            top, last = score[:, 0].tolist(), score[:, -1].tolist()
            floor = [max(f, x) for f, x in zip(floor, last)]
            if all(t + b[d + 1] < f for t, b, f in zip(top, best_next, floor)):
                break
    D = len(scores)
    scores = torch.stack(scores, 1).flatten(1)  # [R, D*B]; flat index d*B + rank follows the tie order
    parent_rank = torch.stack(parent_ranks, 1).flatten(1)
    token = cand_tokens[:, :D].gather(2, torch.stack(cands, 1)).flatten(1)

    top_score, top = _top(scores, bmax)
    return assemble(root_tokens, scores, parent_rank, token, top_score, top, budget, bmax,
                    torch.stack(siblings, 1).flatten(1))


def build_markov_chain(root_tokens: Tensor, cand_tokens: Tensor, trans_logp: Tensor) -> TreeSpec:
    """The greedy path: at each depth the most likely candidate given the one chosen before it
    (on a tie, the lower candidate index). D small gathers, no host sync."""
    R, D, K = cand_tokens.shape
    P = trans_logp.shape[2]
    prev = torch.zeros(R, 1, dtype=torch.int64, device=cand_tokens.device)
    picks = []
    for d in range(D):
        row = prev if (d > 0 and P > 1) else torch.zeros_like(prev)
        lp = trans_logp[:, d].gather(1, row[:, :, None].expand(-1, 1, K))[:, 0]  # [R, K]
        prev = lp.argmax(-1, keepdim=True)
        picks.append(cand_tokens[:, d].gather(1, prev))
    return chain_spec(torch.cat([root_tokens.to(torch.int64).reshape(R, 1)] + picks, 1))
