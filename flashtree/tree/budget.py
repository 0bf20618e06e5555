"""Choosing a tree's size after seeing the draft: expected acceptance per budget, and truncation.

Under the drafter's factorised distribution a node is reached with the probability of its
prefix, so the top-b tree accepts sum(exp(score)) of its b best nodes in expectation. Both
functions rank nodes by the builder's tie rule (score desc, then shallower, then level rank),
which is node order among equal scores, so a truncated tree is exactly the smaller build.
"""

import torch
from torch import Tensor

from flashtree.tree.spec import TreeSpec


def _ranked(spec: TreeSpec) -> tuple[Tensor, Tensor]:
    if spec.scores is None:
        raise ValueError("this TreeSpec has no scores; build it with build_tree")
    drafted = spec.scores[:, 1:]
    sorted_scores, order = torch.sort(drafted, dim=1, descending=True, stable=True)
    return sorted_scores, order


def expected_accepts(spec: TreeSpec) -> Tensor:
    """[R, N-1]: entry b-1 = expected accepted drafted nodes of the top-b subtree (drafter's view)."""
    sorted_scores, _ = _ranked(spec)
    return sorted_scores.exp().cumsum(1)


def truncate(spec: TreeSpec, budget: int) -> TreeSpec:
    """The top-`budget` nodes of a built tree, re-flattened (same as building with that budget)."""
    R, N = spec.tokens.shape
    if budget + 1 >= N:
        return spec
    _, order = _ranked(spec)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(N - 1, device=order.device).expand(R, -1))
    keep = torch.cat([torch.ones_like(rank[:, :1], dtype=torch.bool),
                      (rank < budget) & (spec.tokens[:, 1:] >= 0)], 1)
    # Kept nodes keep their relative (topological) order: new index = kept nodes before them.
    new_index = keep.long().cumsum(1) - 1
    src = torch.sort(torch.where(keep, torch.arange(N, device=keep.device), N), dim=1).values[:, : budget + 1]
    valid = src < N
    src = src.clamp(max=N - 1)
    parents = spec.parents.gather(1, src)
    parents = torch.where(parents >= 0, new_index.gather(1, parents.clamp(min=0)), -1)
    return TreeSpec(
        tokens=torch.where(valid, spec.tokens.gather(1, src), -1),
        parents=torch.where(valid, parents, torch.where(torch.arange(budget + 1, device=src.device) == 0, -1, 0)),
        depths=torch.where(valid, spec.depths.gather(1, src), 1).masked_fill(
            torch.arange(budget + 1, device=src.device) == 0, 0),
        sizes=valid.sum(1),
        max_depth=min(spec.depth_bound, budget),
        scores=torch.where(valid, spec.scores.gather(1, src), float("-inf")),
    )
