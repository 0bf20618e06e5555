"""One verify window from rows drafted differently: trees, chains and lone roots (plain AR steps).

The speculation policy decides per request whether to draft, and how, so a round's rows come
from different builders. These helpers widen each part to a common node count with the padding
every builder uses (token -1, parent 0, depth 1, score -inf) and put the drafted rows back at
their batch rows, on the device and without a host read.
"""
import torch
from torch import Tensor

from flashtree.tree.spec import TreeSpec


def pad_spec(spec: TreeSpec, n: int) -> TreeSpec:
    """The same trees with n nodes per row (n >= spec.num_nodes); the new nodes are padding."""
    R, N = spec.tokens.shape
    if spec.scores is None:
        raise ValueError("pad_spec needs node scores (build_tree sets them; give a chain its prefix scores)")
    if n == N:
        return spec
    scores = spec.scores
    extra = n - N

    def widen(x: Tensor, fill) -> Tensor:
        return torch.cat([x.expand(R, N), x.new_full((R, extra), fill)], 1)

    ranked = spec.ranks is not None
    return TreeSpec(widen(spec.tokens, -1), widen(spec.parents, 0), widen(spec.depths, 1), spec.sizes,
                    is_chain=False, max_depth=max(spec.depth_bound, 1), scores=widen(scores, float("-inf")),
                    ranks=widen(spec.ranks, n) if ranked else None, first=widen(spec.first, False) if ranked else None)


def root_only(roots: Tensor, n: int) -> TreeSpec:
    """Rows that verify their root alone (a plain AR step), padded to n nodes."""
    R = roots.shape[0]
    tokens = torch.cat([roots.to(torch.int64).reshape(R, 1), roots.new_full((R, n - 1), -1, dtype=torch.int64)], 1)
    idx = torch.arange(n, device=roots.device)
    scores = torch.where(idx == 0, 0.0, float("-inf")).expand(R, n)
    return TreeSpec(tokens, torch.where(idx == 0, -1, 0).expand(R, n), (idx > 0).long().expand(R, n),
                    torch.ones(R, dtype=torch.int64, device=roots.device), is_chain=False,
                    max_depth=1 if n > 1 else 0, scores=scores, ranks=(idx * n).expand(R, n),
                    first=(idx == 0).expand(R, n))


def cat_rows(parts: list[TreeSpec]) -> TreeSpec:
    """Stack parts with one node count (pad them first) into one batch, in order. Node ranks are
    kept only where every part has them."""
    if len(parts) == 1:
        return parts[0]
    ranked = all(p.ranks is not None for p in parts)
    return TreeSpec(
        tokens=torch.cat([p.tokens for p in parts]),
        parents=torch.cat([p.parents.expand_as(p.tokens) for p in parts]),
        depths=torch.cat([p.depths.expand_as(p.tokens) for p in parts]),
        sizes=torch.cat([p.sizes for p in parts]),
        is_chain=False,
        max_depth=max(p.depth_bound for p in parts),
        scores=torch.cat([p.scores for p in parts]),
        ranks=torch.cat([p.ranks.expand_as(p.tokens) for p in parts]) if ranked else None,
        first=torch.cat([p.first.expand_as(p.tokens) for p in parts]) if ranked else None,
    )


def place_rows(base: TreeSpec, rows: Tensor, part: TreeSpec) -> TreeSpec:
    """base with its rows `rows` [k] (device indices) replaced by part's k rows (same node count)."""
    def put(x: Tensor, y: Tensor) -> Tensor:
        return x.contiguous().index_copy(0, rows, y.expand_as(y).contiguous())

    ranked = base.ranks is not None and part.ranks is not None
    return TreeSpec(
        tokens=put(base.tokens, part.tokens),
        parents=put(base.parents, part.parents.expand_as(part.tokens)),
        depths=put(base.depths, part.depths.expand_as(part.tokens)),
        sizes=put(base.sizes, part.sizes),
        is_chain=False,
        max_depth=max(base.depth_bound, part.depth_bound),
        scores=put(base.scores, part.scores),
        ranks=put(base.ranks.expand_as(base.tokens), part.ranks) if ranked else None,
        first=put(base.first.expand_as(base.tokens), part.first) if ranked else None,
    )
