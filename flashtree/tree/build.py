"""Exact top-B prefix trees (DDTree) and chains (DFlash) from the drafter's per-depth logits.

Tie rule, used by every function here: a prefix ranks higher when its score (sum of float32
log-probs, added root to leaf) is higher; on equal score the shallower prefix wins; then the one
with the lower rank in its level. Level d is ordered by (score, parent's rank in level d-1,
token's rank at depth d), and tokens at a depth are ranked by (log-prob desc, token id asc).
A child never beats its parent (same or lower score, deeper), so every top-b set is prefix-closed.
Prefixes with score -inf (a token of probability zero) are never drafted.
Log-probs are `torch.log_softmax(draft_logits.float(), -1)` bit for bit (NaN logits are unsupported).
"""
import functools
import heapq
import operator

import numpy as np
import torch
from torch import Tensor

from flashtree.errors import FlashtreeError
from flashtree.tree.host import build_tree_host, levels_needed, pair_list
from flashtree.tree.spec import TreeSpec, chain_spec


def _topk(x: Tensor, k: int, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Top-k of log-probs x (all <= 0) along the last dim by (value desc, id asc); ids default to positions.

    torch.topk leaves the order of equal values unspecified, so select on an exact int64 key:
    with the sign bit forced on (harmless for x <= 0, and it folds +0.0 into -0.0), a float's bits
    read as a signed int grow as the value falls, so the smallest bits * 2^32 + id wins.
    Returns the values and their ids. Only for short lists; the vocabulary goes through _token_topk.
    """
    pos = torch.arange(x.shape[-1], device=x.device) if ids is None else ids
    key = torch.add(pos, torch.copysign(x, -1.0).view(torch.int32).to(torch.int64), alpha=1 << 32)
    sel = key.topk(k, dim=-1, largest=False).indices
    return x.gather(-1, sel), sel if ids is None else ids.gather(-1, sel)


MARGIN = 16  # extra candidates per depth; a tie group at the k-th value must outrun it to cost a full pass


def _token_topk(lp: Tensor, k: int, host: bool) -> tuple[Tensor, Tensor]:
    """The same result as _topk(lp, k) for lp [R, D, V], without its [R, D, V] int64 keys.

    Why it is the same:
    1. S = torch.topk(lp, c) for some c >= k: no entry outside S is larger than one inside, but
       which of several equal entries make it in is unspecified.
    2. Let t be the k-th largest value (a value, so it does not depend on that choice) and g < k
       the number of entries > t. All g are in S (if one were outside, all c >= k members of S
       would be > t). So the exact answer is those g, then the k - g lowest-id entries equal to t.
    3. If every entry equal to t is in S too, _topk over S with the entries' own ids is exact.
       That holds when min(S) < t (c = k + MARGIN), or when only k entries of the row are >= t
       (c = k; used where k + MARGIN would push the CPU's topk off its fast partial sort, which
       needs 64c <= V, while c = k keeps it, e.g. k = 64 at V = 4096).
    4. Otherwise some entries equal to t may lie outside S (a tie group at t that outruns the
       margin), and _tie_fix finds the row's ties over the whole vocabulary. It is exact for any row
       given step 2, so without `host` it runs on every row with c = k (no host read, fixed shapes);
       with `host`, one read picks out the rows that need it, and usually there are none.
    Values are gathered from lp, so they carry lp's own bits.
    """
    R, D, V = lp.shape
    if not host:
        c = k
    elif V <= k + MARGIN:
        c = V  # S is the whole row: step 3 holds trivially
    else:
        count = 64 * (k + MARGIN) > V >= 64 * k
        c = k if count else k + MARGIN
    vals, ids = lp.topk(c, dim=-1)  # values descending: vals[..., k-1] = t
    top_lp, top_id = _topk(vals, k, ids)
    if c == V:
        return top_lp, top_id
    t = vals[..., k - 1 : k]
    flat = lp.view(R * D, V)
    top_lp, top_id = top_lp.reshape(R * D, k), top_id.reshape(R * D, k)
    if not host:
        top_lp, top_id = _tie_fix(flat, top_lp, top_id, t.reshape(R * D))
    else:
        # S holds all k entries >= t unless another one equals t: more than k entries >= t, or
        # (with the margin) the last candidate still equal to t.
        need = (lp >= t).sum(-1) > k if c == k else vals[..., -1:] == t
        if need.any():
            rows = need.flatten().nonzero()[:, 0]
            top_lp[rows], top_id[rows] = _tie_fix(flat[rows], top_lp[rows], top_id[rows], t.reshape(R * D)[rows])
    return top_lp.view(R, D, k), top_id.view(R, D, k)


def _tie_fix(lp: Tensor, top_lp: Tensor, top_id: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """Exact top-k rows [F, k] when the entries equal to the k-th value t [F] may lie anywhere in lp [F, V].

    Keeps the leading entries > t (already exact, step 2 above) and fills the rest with the lowest
    ids whose value equals t: the top-k of -id over those entries (-inf elsewhere) lists them by
    ascending id, and float32 holds every id below 2^24 exactly, so that top-k has no ties.
    """
    F, V = lp.shape
    k = top_lp.shape[1]
    neg_id = torch.arange(0, -V, -1, dtype=torch.float32, device=lp.device)
    tie_id = torch.where(lp == t[:, None], neg_id, float("-inf")).topk(k, dim=1).indices
    above = (top_lp > t[:, None]).sum(1, keepdim=True)  # g per row
    j = torch.arange(k, device=lp.device)
    ids = torch.where(j < above, top_id, tie_id.gather(1, (j - above).clamp(min=0)))
    return lp.gather(1, ids), ids


@functools.lru_cache(maxsize=64)
def _pairs(width: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """host.pair_list on `device`: the (parent rank, token rank) candidates of a level's top-`width`."""
    parent, token = pair_list(width, k)
    return torch.tensor(parent, device=device), torch.tensor(token, device=device)


def _levels_needed(tok_lp: Tensor, width: int) -> int:
    """host.levels_needed from one host read of tok_lp [R, D, K]: the depths that can hold a node."""
    return levels_needed(tok_lp.detach().cpu().numpy(), width)


def _width(budget: int | Tensor, max_budget: int | None) -> int:
    """Nodes per row past the root: max_budget if given, else the budget's max (a host read for a tensor)."""
    if max_budget is not None:
        width = max_budget
    elif isinstance(budget, Tensor):
        width = int(budget.max())
    else:
        width = budget
    try:
        width = operator.index(width)
    except TypeError:
        raise FlashtreeError(f"tree budget must be a whole number of nodes, got {width!r}") from None
    if width < 1:
        raise FlashtreeError(f"tree budget must be at least 1 node, got {width}; pass budget >= 1")
    return width


def build_tree(root_tokens: Tensor, draft_logits: Tensor, budget: int | Tensor, *,
               max_budget: int | None = None, prune: bool | None = None) -> TreeSpec:
    """The top-budget[r] prefixes (lengths 1..D) of each row's factorised draft distribution.

    root_tokens [R], draft_logits [R, D, V], budget: drafted nodes per row (root excluded), int or [R].
    Built depth by depth: level d is the top-B of (level d-1 x top-min(B, V) tokens at depth d),
    which is exact because every member of a level has its parent in the previous one; the tree is
    the top-budget of the union of levels. Output: root, then nodes by (depth, rank in level),
    N = 1 + max budget, short rows padded.

    max_budget: a static bound on the budget. Then N = 1 + max_budget, a row's budget is capped at
    it, and a tensor budget costs no host read (a row's nodes do not depend on N, only its padding).
    prune: whether to read small tensors on the host to skip work that provably cannot change the
    tree: the depths past the first one that cannot place a node, and the full-vocabulary tie pass
    of _token_topk for rows that do not need it. None: only on the CPU, where reads are free. With
    False the build makes no host read and its shapes depend only on (R, D, V, N), as a compiled
    or graph-captured caller needs. The tree is the same either way; pruning may lower max_depth.
    A pruned build of CPU logits runs in numpy (flashtree.tree.host): on the CPU the tensor build's
    cost is per-op dispatch on small tensors, not arithmetic.
    """
    V = draft_logits.shape[-1]
    dev = draft_logits.device
    if V > 1 << 24:  # _tie_fix keys token ids as exact float32 integers
        raise FlashtreeError(f"a vocabulary of {V} tokens is too large for the tree builder (at most 2^24)")
    prune = dev.type == "cpu" if prune is None else prune
    bmax = _width(budget, max_budget)
    if prune and dev.type == "cpu":
        return build_tree_host(root_tokens, draft_logits, budget, bmax)
    return build_tree_tensor(root_tokens, draft_logits, budget, bmax, prune)


def build_tree_tensor(root_tokens: Tensor, draft_logits: Tensor, budget: int | Tensor, bmax: int,
                      prune: bool) -> TreeSpec:
    """build_tree as tensor ops on the logits' device, for a checked bound bmax on the budget."""
    R, D, V = draft_logits.shape
    dev = draft_logits.device
    K = min(bmax, V)
    lp = torch.log_softmax(draft_logits.float(), dim=-1)
    tok_lp, tok_id = _token_topk(lp, K, host=prune)  # [R, D, K]
    del lp
    pair_p, pair_t = _pairs(bmax, K, dev)

    if prune:
        D = _levels_needed(tok_lp, bmax)
    pair_lp = tok_lp[:, :D, pair_t].unbind(1)  # per depth [R, C]
    score = torch.full((R, bmax), float("-inf"), device=dev)  # level 0: the root alone
    score[:, 0] = 0.0
    scores, picked = [], []
    for d in range(D):
        # The pair list is in tie order, so a stable sort by score is the (score, position) rule
        # (scores are never -0.0: log_softmax gives +0.0 to a certain token, so zeros cannot split a tie).
        score, sel = (score[:, pair_p] + pair_lp[d]).sort(dim=1, descending=True, stable=True)
        score, sel = score[:, :bmax], sel[:, :bmax]
        scores.append(score)
        picked.append(sel)
    picked = torch.stack(picked, 1)  # [R, D, B] positions in the pair list
    scores = torch.stack(scores, 1).flatten(1)  # [R, D*B]; flat index d*B + rank follows the tie order
    parent_rank = pair_p[picked].flatten(1)
    token = tok_id.gather(2, pair_t[picked]).flatten(1)

    sibling = pair_t[picked].flatten(1)
    top_score, top = _topk(scores, bmax)
    return assemble(root_tokens, scores, parent_rank, token, top_score, top, budget, bmax, sibling)


def assemble(root_tokens: Tensor, scores: Tensor, parent_rank: Tensor, token: Tensor, top_score: Tensor,
             top: Tensor, budget: int | Tensor, bmax: int, sibling: Tensor) -> TreeSpec:
    """Flatten per-depth levels into a TreeSpec: the top-budget of their union (top_score/top,
    already in the tie order) re-sorted by (depth, level rank), parents mapped to output slots.

    scores, parent_rank, token, sibling [R, D*bmax]: level d's rank-i entry at flat index
    d*bmax + i, its parent's rank in level d-1, its token, and its rank among its parent's
    children (0: the best child). Shared by the marginal and the Markov builders.
    """
    R, flat_len = scores.shape
    D = flat_len // bmax
    dev = scores.device
    rank = torch.arange(bmax, device=dev)
    if isinstance(budget, Tensor):
        budget = budget.to(dev).reshape(-1, 1)
    chosen = (rank < budget) & (top_score > float("-inf"))
    # By (depth, level rank), padding last; `place` is each output node's position in `top`.
    order, place = torch.where(chosen, top, D * bmax).sort(dim=1)
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
        ranks=torch.cat([torch.zeros_like(root), place + 1], 1),
        first=torch.cat([torch.ones_like(root, dtype=torch.bool), sibling.gather(1, flat) == 0], 1),
    )


def build_chain(root_tokens: Tensor, draft_logits: Tensor) -> TreeSpec:
    """DFlash: the argmax token at every depth (ties to the lower id), as a chain."""
    R = draft_logits.shape[0]
    tokens = torch.cat([root_tokens.to(torch.int64).reshape(R, 1), draft_logits.argmax(-1)], 1)
    return chain_spec(tokens)


def build_tree_reference(root_token: int, draft_logits: Tensor, budget: int) -> list[tuple[int, ...]]:
    """Best-first search with a heap over prefixes: the test oracle for build_tree.

    Pops prefixes in the tie order. Children enter the heap lazily: a popped prefix pushes its
    best child, and a popped child pushes its next sibling in its depth's token order. A sibling
    never comes before the one ahead of it in the tie order, so the pops are those of a heap that
    held every child, while the heap stays O(budget) (this is what lets it run at full vocabularies).
    A parent is popped before its children, so its rank in its level (pops so far at its depth)
    is known by then. Returns the drafted token tuples (root excluded) in pop order.
    """
    del root_token  # the root is fixed; it does not enter any score
    lp = torch.log_softmax(draft_logits.float(), dim=-1).cpu().numpy()
    D, V = lp.shape
    order = [np.lexsort((np.arange(V), -lp[d])) for d in range(D)]  # (log-prob desc, id asc)
    heap: list = []

    def push(parent: tuple[int, ...], parent_score: np.float32, parent_rank: int, j: int) -> None:
        """Push the child of `parent` holding the j-th best token at its depth, unless it scores -inf."""
        d = len(parent)
        if d == D or j == V:
            return
        v = int(order[d][j])
        s = np.float32(parent_score + lp[d, v])
        if s > -np.inf:  # later siblings score -inf too
            heapq.heappush(heap, (-float(s), d + 1, parent_rank, j, parent + (v,), s, parent_score))

    push((), np.float32(0.0), 0, 0)
    popped_at_depth = [0] * (D + 1)
    out = []
    while heap and len(out) < budget:
        _, depth, parent_rank, j, prefix, score, parent_score = heapq.heappop(heap)
        out.append(prefix)
        push(prefix[:-1], parent_score, parent_rank, j + 1)  # next sibling
        push(prefix, score, popped_at_depth[depth], 0)  # first child
        popped_at_depth[depth] += 1
    return out
