"""One verify window from drafted rows and lone roots (plain AR steps), as the policy decides per
request: lone roots get the builders' padding (token -1, parent 0, depth 1, score -inf), on the
device, without a host read; a captured round drafts every row and drops the AR rows' drafts."""
import dataclasses

import torch
from torch import Tensor

from flashtree.tree.spec import TreeSpec


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


def place_rows(base: TreeSpec, rows: Tensor, part: TreeSpec) -> TreeSpec:
    """base with its rows `rows` [k] (device indices) replaced by part's k rows (same node count);
    scores and ranks are kept where both have them."""
    def put(x: Tensor, y: Tensor) -> Tensor:
        return x.contiguous().index_copy(0, rows, y.contiguous())

    ranked = base.ranks is not None and part.ranks is not None
    scored = base.scores is not None and part.scores is not None
    return TreeSpec(tokens=put(base.tokens, part.tokens), sizes=put(base.sizes, part.sizes),
                    parents=put(base.parents, part.parents.expand_as(part.tokens)),
                    depths=put(base.depths, part.depths.expand_as(part.tokens)),
                    is_chain=False, max_depth=max(base.depth_bound, part.depth_bound),
                    scores=put(base.scores, part.scores) if scored else None,
                    ranks=put(base.ranks.expand_as(base.tokens), part.ranks) if ranked else None,
                    first=put(base.first.expand_as(base.tokens), part.first) if ranked else None)


def drop_drafts(spec: TreeSpec, keep: Tensor) -> TreeSpec:
    """spec with the drafted nodes of rows not in keep [R] (bool) made padding (token -1), which no pick
    matches: those rows emit their root's pick, the AR step's token, and the window keeps its shape."""
    drafted = torch.arange(spec.num_nodes, device=keep.device) > 0
    return dataclasses.replace(spec, tokens=spec.tokens.masked_fill(drafted & ~keep[:, None], -1))
