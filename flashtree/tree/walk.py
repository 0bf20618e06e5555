"""The accept walk: follow the target's picks down the draft tree, as gathers with no host sync."""
from dataclasses import dataclass

import torch
from torch import Tensor

from flashtree.tree.spec import TreeSpec


@dataclass
class WalkResult:
    """What one round accepts. Widths are depth_bound + 1, so shapes never depend on the outcome."""

    path: Tensor  # [R, Dmax+1] accepted node indices, path[:, 0] = 0 (root); -1 past num_nodes
    num_nodes: Tensor  # [R] accepted nodes incl. root (>= 1) = tokens this round emits
    tokens: Tensor  # [R, Dmax+1] emitted tokens: accepted drafted tokens, then the pick at the last
    # accepted node (the next round's root, at tokens[r, num_nodes[r] - 1]); -1 padded


def _next_node(spec: TreeSpec, picks: Tensor) -> Tensor:
    """next[r, i]: the child of node i whose token is the pick at i, or -1. Siblings hold distinct tokens.

    O(N): node c is the hit of its parent when its token equals the parent's pick; each parent
    takes its lowest-index hit by a scatter-amin over parents (padding and the root never hit).
    """
    R, N = spec.tokens.shape
    idx = torch.arange(N, device=picks.device)
    if spec.is_chain:
        hit = spec.tokens[:, 1:] == picks[:, :-1]
        return torch.cat([torch.where(hit, idx[1:], -1), idx.new_full((R, 1), -1)], 1)
    parent = spec.parents.clamp(min=0)
    hit = (spec.tokens == picks.gather(1, parent)) & (spec.tokens >= 0) & (spec.parents >= 0)
    nxt = idx.new_full((R, N), N).scatter_reduce_(1, parent, torch.where(hit, idx, N), "amin")
    return torch.where(nxt < N, nxt, -1)


def accept_walk(spec: TreeSpec, picks: Tensor) -> WalkResult:
    """Walk from the root while the target's pick at a node is one of its children.

    picks [R, N]: the target's token at every node (argmax or a sample; the walk is lossless for
    either). Pointer-chases `depth_bound` steps for all rows at once; the caller syncs once on
    num_nodes.
    """
    R, n_nodes = spec.tokens.shape
    if n_nodes == 1 and spec.depth_bound == 0:  # a lone root (an AR step): accepted, its pick emitted
        return WalkResult(path=picks.new_zeros(R, 1), num_nodes=picks.new_ones(R), tokens=picks[:, :1])
    nxt = _next_node(spec, picks)
    node = torch.zeros(R, dtype=torch.int64, device=picks.device)
    path = [node]
    for _ in range(spec.depth_bound):
        node = torch.where(node >= 0, nxt.gather(1, node.clamp(min=0)[:, None])[:, 0], -1)
        path.append(node)
    path = torch.stack(path, 1)
    num_nodes = (path >= 0).sum(1)
    last = path.gather(1, (num_nodes - 1)[:, None])
    bonus = picks.gather(1, last)

    k = torch.arange(path.shape[1], device=path.device)
    drafted = spec.tokens.gather(1, path[:, 1:].clamp(min=0))
    drafted = torch.cat([drafted, drafted.new_full((R, 1), -1)], 1)  # slot k holds path[k+1]'s token
    n = num_nodes[:, None]
    tokens = torch.where(k < n - 1, drafted, torch.where(k == n - 1, bonus, -1))
    return WalkResult(path=path, num_nodes=num_nodes, tokens=tokens)
