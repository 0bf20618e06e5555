"""Flattened draft trees, and the ancestor structure the verifier attends along."""
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TreeSpec:
    """A batch of draft trees, flattened root-first in topological order (parent index < child index).

    Positions are not stored: a node sits at `prefix_len + depth`.
    `max_depth` is a static bound on `depths` (the draft length for built trees). Builders record it
    so the ancestor table and the accept walk can size themselves without a host sync; when it is
    None, `depth_bound` reads `depths.max()` (one sync).
    """

    tokens: Tensor  # [R, N] int64; node 0 is the root (the bonus token); padding nodes hold -1
    parents: Tensor  # [R, N] int64; -1 for the root; padding nodes point at 0 (the root)
    depths: Tensor  # [R, N] int64; root 0; padding nodes have depth 1
    sizes: Tensor  # [R] int64: real nodes per row, root included
    is_chain: bool = False  # every row is a plain chain (parents[i] = i-1) with no padding
    max_depth: int | None = None
    scores: Tensor | None = None  # [R, N] drafter log-prob of each node's prefix (root 0, padding -inf)
    # Built trees also record, per node, its place in the tree's own order (the tie rule's: the
    # top-b subtree is the nodes ranked 1..b; root 0) and whether it is its parent's best child
    # (the root counts as one): what a walk's path needs to say what every smaller tree and the
    # chain of best children would have accepted. Padding nodes: any value (no walk reaches them).
    ranks: Tensor | None = None  # [R, N] int64
    first: Tensor | None = None  # [R, N] bool

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def depth_bound(self) -> int:
        return int(self.depths.max()) if self.max_depth is None else self.max_depth


def chain_spec(tokens: Tensor) -> TreeSpec:
    """A chain per row (DFlash): node i is at depth i with parent i-1. Index tensors are broadcast views."""
    R, N = tokens.shape
    idx = torch.arange(N, device=tokens.device)
    return TreeSpec(
        tokens=tokens,
        parents=(idx - 1).expand(R, N),
        depths=idx.expand(R, N),
        sizes=torch.full((R,), N, dtype=torch.int64, device=tokens.device),
        is_chain=True,
        max_depth=N - 1,
    )


def ancestor_table(spec: TreeSpec) -> Tensor:
    """t[r, i, k] = the ancestor of node i at depth k (i itself at k = depth[i]), -1 for k > depth[i].

    Built by chasing parents `depth_bound` times with gathers for all nodes at once, so its cost
    grows with depth, not with the number of nodes. Attention masks and recurrent-state
    gathers both read it.
    """
    R, N = spec.tokens.shape
    dmax = spec.depth_bound
    k = torch.arange(dmax + 1, device=spec.tokens.device)
    if spec.is_chain:
        i = torch.arange(N, device=k.device)[:, None]
        return torch.where(k <= i, k, -1).expand(R, N, dmax + 1)
    node = torch.arange(N, device=k.device).expand(R, N)
    ups = [node]  # ups[s] = s-th ancestor; entries past the root are never read
    for _ in range(dmax):
        node = spec.parents.gather(1, node.clamp(min=0))
        ups.append(node)
    steps = spec.depths[..., None] - k  # how far up the depth-k ancestor is
    table = torch.stack(ups, -1).gather(2, steps.clamp(min=0))
    return table.masked_fill(steps < 0, -1)


def ancestor_mask(spec: TreeSpec) -> Tensor:
    """m[r, i, j]: node i may attend node j, i.e. j is an ancestor of i or i itself.

    j is an ancestor-or-self of i iff i's ancestor at depth[j] is j: one gather and a compare.
    Chains take the lower-triangular matrix directly.
    """
    R, N = spec.tokens.shape
    dev = spec.tokens.device
    if spec.is_chain:
        return torch.ones(N, N, dtype=torch.bool, device=dev).tril().expand(R, N, N)
    table = ancestor_table(spec)
    at_depth_j = table.gather(2, spec.depths[:, None, :].expand(R, N, N))
    return at_depth_j == torch.arange(N, device=dev)
