"""One verify step's trees: which rows of vLLM's flattened batch hold them, and how those rows attend.

A request's tree enters the batch as its draft list, one row per node at vLLM's usual slots
(prefix + node index). The plan moves each node to position prefix + depth and gives the attention
layers the ancestor mask; after the walk it says which slots' K/V move to which.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from flashtree.integrations.vllm.trees import TreeBook
from flashtree.sampling import SamplingParams
from flashtree.tree import TreeSpec, ancestor_mask


@dataclass
class VerifyPlan:
    req_ids: list[str]
    req_index: Tensor  # [Rt] the trees' rows in vLLM's request batch
    start: Tensor  # [Rt] each tree's first token row (its root) in the flattened batch
    size: Tensor  # [Rt] nodes per tree, root included
    prefix: Tensor  # [Rt] committed tokens before the root, i.e. the root's position
    spec: TreeSpec  # [Rt, N], padded as flashtree pads; max_depth is the deepest node's depth
    params: list[SamplingParams]
    seeds: list[int]
    rows: Tensor  # [Rt, N] token row of each node; padding repeats the tree's last row
    valid: Tensor  # [Rt, N] real nodes
    mask: Tensor  # [Rt, N, N] node i sees node j (ancestor or itself)
    row_slice: slice | None = None  # the trees' rows as one slice, when they are adjacent and all N long
    caches: list[Tensor] = field(default_factory=list)  # the target layers' KV caches, as attention met them
    slot_mapping: Tensor | None = None  # the verify batch's slots: row i holds position prefix + node index
    _attention: dict[tuple, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.size.sum())

    @property
    def greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    def positions(self) -> tuple[Tensor, Tensor]:
        """(token rows, positions) of every real node: its position is prefix + depth."""
        pos = self.prefix[:, None] + self.spec.depths
        return self.rows[self.valid], pos[self.valid]

    def chain_positions(self) -> tuple[Tensor, Tensor]:
        """(token rows, positions) as vLLM assigned them: prefix + node index."""
        pos = self.prefix[:, None] + torch.arange(self.rows.shape[1])
        return self.rows[self.valid], pos[self.valid]

    def attention_inputs(self, block_table: Tensor, block: int, group: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """What every target layer's tree attention shares this step: the cache blocks [Rt, nblk] that hold
        each request's positions up to its last node, and the additive mask [Rt, 1, group * N, nblk * block]
        (0 where a node attends: every committed position, then its ancestors and itself; rows
        repeated for the `group` query heads that share a KV head)."""
        key = (block, group, dtype)
        if key not in self._attention:
            Rt, N = self.rows.shape
            nblk = -(-int((self.prefix + self.size).max()) // block)
            columns = nblk * block
            rel = torch.arange(columns)[None] - self.prefix[:, None]  # [Rt, columns]: node index at each position
            ancestors = self.mask.gather(2, rel.clamp(0, N - 1)[:, None, :].expand(Rt, N, columns))
            allowed = ((rel < 0)[:, None, :] | (((rel >= 0) & (rel < N))[:, None, :] & ancestors))[:, None]
            additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
            self._attention[key] = (block_table[self.req_index, :nblk].long(), additive.repeat(1, 1, group, 1))
        return self._attention[key]


def plan_verify(book: TreeBook, scheduled: dict[str, list[int]], req_id_to_index: dict[str, int],
                query_start: np.ndarray, num_computed: np.ndarray, input_ids: Tensor) -> VerifyPlan | None:
    """The plan for the requests whose scheduled drafts are (a prefix of) the tree they drafted.

    A request whose drafts differ from its tree (none was drafted, or the scheduler dropped it)
    verifies as vLLM's chain. Trees cut short by the scheduler stay trees: their nodes come in
    parent-before-child order.
    """
    trees, params = book.take()
    chosen = []
    for req_id, drafted in scheduled.items():
        tree = trees.get(req_id)
        n = len(drafted)
        if tree is None or n == 0 or drafted != tree.tokens[:n]:
            continue
        i = req_id_to_index[req_id]
        start = int(query_start[i])
        if int(query_start[i + 1]) - start != n + 1:
            continue
        chosen.append((i, start, n + 1, req_id))
    if not chosen:
        return None
    chosen.sort()
    Rt, N = len(chosen), max(size for _, _, size, _ in chosen)
    tokens = np.full((Rt, N), -1, dtype=np.int64)
    parents = np.zeros((Rt, N), dtype=np.int64)
    depths = np.ones((Rt, N), dtype=np.int64)
    for j, (_, start, size, req_id) in enumerate(chosen):
        tree = trees[req_id]
        tokens[j, 0] = int(input_ids[start])
        tokens[j, 1:size] = tree.tokens[:size - 1]
        parents[j, :size] = tree.parents[:size]
        depths[j, :size] = tree.depths[:size]
    req_index, start, size = (torch.tensor([c[k] for c in chosen]) for k in range(3))
    # The deepest node bounds the walk and the ancestor table: a cut tree is often shallower than the drafter's block.
    spec = TreeSpec(tokens=torch.from_numpy(tokens), parents=torch.from_numpy(parents),
                    depths=torch.from_numpy(depths), sizes=size, max_depth=int(depths.max()))
    node = torch.arange(N)
    first = chosen[0][1]
    adjacent = all(n == N and row == first + j * N for j, (_, row, n, _) in enumerate(chosen))
    return VerifyPlan(
        req_ids=[c[3] for c in chosen], req_index=req_index, start=start, size=size,
        prefix=torch.from_numpy(num_computed[req_index.numpy()].astype(np.int64)), spec=spec,
        params=[params[c[3]] for c in chosen], seeds=[book.seed(c[3], params[c[3]]) for c in chosen],
        rows=start[:, None] + torch.minimum(node, size[:, None] - 1), valid=node < size[:, None],
        mask=ancestor_mask(spec), row_slice=slice(first, first + Rt * N) if adjacent else None)
