"""What a draft tree is worth: each node's chance of being accepted, as the drafter sees it, and
summed by depth and kind or per tree size; and what the target made of it.

Under the drafter's own distribution a node is reached with its prefix probability exp(score).
The drafter misjudges that in a way that depends on where the node sits (DESIGN.md: the spine
of top-1 children holds up far better than a branch taken after a sibling), so the engine
corrects it per depth and kind (SPINE, BRANCH), learning the correction from what the target
accepted. Everything here is batched tensor code with no host read.
"""
import torch
from torch import Tensor

from flashtree.tree.spec import TreeSpec

SPINE, BRANCH = 0, 1


def spine_mask(spec: TreeSpec) -> Tensor:
    """[R, N] bool: the node and every ancestor are their parent's best child (highest score; on
    equal scores the lower index, which is the builders' tie order). The root is on the spine."""
    R, N = spec.tokens.shape
    if spec.is_chain:
        return torch.ones(R, N, dtype=torch.bool, device=spec.tokens.device)
    idx = torch.arange(N, device=spec.tokens.device).expand(R, N)
    parent = spec.parents.expand(R, N).clamp(min=0)
    is_best = (_best_child(spec).gather(1, parent) == idx) | (idx == 0)
    on = is_best
    for _ in range(spec.depth_bound):  # a node is on the spine when its parent is, too
        on = is_best & on.gather(1, parent)
    return on


def node_kinds(spec: TreeSpec) -> Tensor:
    """[R, N] int64: SPINE or BRANCH for every node."""
    return torch.where(spine_mask(spec), SPINE, BRANCH)


def node_reach(spec: TreeSpec) -> Tensor:
    """[R, N]: exp(score), the drafter's chance of the walk reaching each drafted node; 0 for the
    root and padding."""
    R, N = spec.tokens.shape
    drafted = (spec.tokens >= 0) & (torch.arange(N, device=spec.tokens.device) > 0)
    return torch.where(drafted, spec.scores.exp(), 0.0)


def value_curve(spec: TreeSpec, values: Tensor) -> Tensor:
    """[R, N-1]: entry b-1 = summed per-node values [R, N] over the top-b subtree (the top-b nodes by
    score in the builders' tie order, which is exactly the tree a budget-b build gives)."""
    scores = torch.where(spec.tokens >= 0, spec.scores, float("-inf"))[:, 1:]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return values[:, 1:].gather(1, order).cumsum(1)


def depth_mass(spec: TreeSpec, kinds: Tensor, raw: Tensor, depth: int) -> Tensor:
    """[R, depth, 2]: summed raw reach probability of the drafted nodes at each depth and kind,
    the drafter's prediction of how many nodes of that depth and kind the walk accepts."""
    R, N = spec.tokens.shape
    d = (spec.depths.expand(R, N) - 1).clamp(0, depth - 1)
    out = torch.zeros(R, depth * 2, device=raw.device, dtype=raw.dtype)
    return out.scatter_add_(1, d * 2 + kinds, raw).view(R, depth, 2)




def path_reach(spec: TreeSpec, edge_logp: Tensor) -> Tensor:
    """[R, N]: log-probability that the walk reaches each node, from edge_logp [R, N] = the
    log-probability that the target's pick at a node's parent is the node's token (root: 0)."""
    R, N = spec.tokens.shape
    parent = spec.parents.expand(R, N).clamp(min=0)
    e = torch.where(torch.arange(N, device=edge_logp.device) == 0, 0.0, edge_logp)
    reach = e
    for _ in range(spec.depth_bound):
        reach = e + reach.gather(1, parent)
    return reach


def walked_mass(spec: TreeSpec, kinds: Tensor, path: Tensor, depth: int) -> Tensor:
    """[R, depth, 2]: the nodes the walk accepted, counted by depth and kind (path [R, A] as from
    accept_walk: node indices, root first, -1 past the accepted ones)."""
    R = path.shape[0]
    node = path[:, 1:].clamp(min=0)
    took = (path[:, 1:] >= 0).to(torch.float32)
    d = (spec.depths.expand_as(spec.tokens).gather(1, node) - 1).clamp(0, depth - 1)
    out = torch.zeros(R, depth * 2, device=path.device)
    return out.scatter_add_(1, d * 2 + kinds.gather(1, node), took).view(R, depth, 2)


def _on_path(spec: TreeSpec, path: Tensor) -> Tensor:
    """[R, N] float: 1 at the nodes of the accepted path (path as from accept_walk)."""
    R, N = spec.tokens.shape
    on = torch.zeros(R, N, device=path.device).scatter_(1, path.clamp(min=0), 1.0)
    return on  # padding (-1) lands on the root, which is on every path anyway


def accepted_by_size(spec: TreeSpec, path: Tensor) -> Tensor:
    """[R, N-1]: entry b-1 = the drafted tokens the walk would have accepted in the top-b subtree.

    Exact, not an estimate: the top-b subtree is prefix-closed and is the tree a budget-b build
    gives, and the target's pick at a node depends only on the node's prefix (and, sampled, on
    noise shared by depth), so the walk there follows this walk's path while the path stays
    inside it, and then stops: it accepts the path's nodes that are in the subtree."""
    return value_curve(spec, _on_path(spec, path))


def _best_child(spec: TreeSpec) -> Tensor:
    """[R, N]: each node's best child (highest score; on equal scores the lower index, the
    builders' tie order), or N where it has none."""
    R, N = spec.tokens.shape
    idx = torch.arange(N, device=spec.tokens.device).expand(R, N)
    real = (spec.tokens >= 0) & (idx > 0)
    parent = spec.parents.expand(R, N).clamp(min=0)
    score = torch.where(real, spec.scores, float("-inf"))
    best = torch.full((R, N), float("-inf"), device=score.device).scatter_reduce(1, parent, score, "amax")
    top = (score == best.gather(1, parent)) & real
    return torch.full((R, N), N, device=score.device).scatter_reduce(1, parent, torch.where(top, idx, N), "amin")


def spine_run(spec: TreeSpec, path: Tensor) -> Tensor:
    """[R]: the accepted path's drafted nodes on the spine, from the root while each is its
    parent's best child: what the chain of best children (as far as this tree holds it) would
    have accepted. Two scatters and the path's own length, no walk over the tree's depth."""
    first = _best_child(spec)
    node, child = path[:, :-1], path[:, 1:]
    on = (child >= 0) & (first.gather(1, node.clamp(min=0)) == child)
    return on.long().cumprod(1).sum(1)

