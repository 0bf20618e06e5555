"""One verify step's trees: which rows of vLLM's flattened batch hold them, and how those rows attend.

A request's tree enters the batch as its draft list, one row per node at vLLM's usual slots
(prefix + node index). The plan moves each node to position prefix + depth and gives the attention
layers the ancestor mask; after the walk it says which slots' K/V move to which.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from flashtree.integrations.vllm.trees import TreeBook
from flashtree.sampling import SamplingParams
from flashtree.tree import TreeSpec


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
    _attention: tuple[tuple, TreeAttention] | None = None

    @functools.cached_property
    def num_rows(self) -> int:
        return int(self.size.sum())

    @property
    def greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    def positions(self) -> tuple[Tensor, Tensor]:
        """(token rows, positions) of every real node: its position is prefix + depth."""
        valid = self.valid.numpy()
        pos = self.prefix.numpy()[:, None] + self.spec.depths.numpy()
        return torch.from_numpy(self.rows.numpy()[valid]), torch.from_numpy(pos[valid])

    def chain_positions(self) -> tuple[Tensor, Tensor]:
        """(token rows, positions) as vLLM assigned them: prefix + node index."""
        valid = self.valid.numpy()
        pos = self.prefix.numpy()[:, None] + np.arange(valid.shape[1])
        return torch.from_numpy(self.rows.numpy()[valid]), torch.from_numpy(pos[valid])

    def attention(self, block_table: Tensor, block: int, kv_heads: int, group: int) -> TreeAttention:
        """The tree attention inputs every target layer shares this step, built by the first layer."""
        key = (block, kv_heads, group)
        if self._attention is None or self._attention[0] != key:
            self._attention = (key, tree_attention_inputs(self, block_table, block, kv_heads, group))
        return self._attention[1]


@dataclass
class TreeAttention:
    """Where the trees' keys lie in the paged cache and which of them each query row sees.

    Rows of a request's queries are ordered (query head in its group, node): a KV head's whole group
    then attends as one matrix.
    """
    first_block: int | None  # the one tree's blocks are first_block.. in a row: read as a slice, no gather
    blocks: Tensor  # [Rt, nblk] cache blocks holding each request's positions up to its last node
    columns: int  # keys read per request: positions 0..columns-1 of its blocks
    mask: Tensor  # [1 or Rt * kv_heads, group * N, columns] float32: 0 where a row attends, -inf elsewhere


def ancestors(parents: np.ndarray, max_depth: int) -> np.ndarray:
    """m[r, i, j]: node j is node i or one of its ancestors (parents [R, N], root -1).

    Reachability in at most max_depth parent steps, by squaring (I + A) ceil(log2) times: a few
    tiny matmuls instead of one gather per depth.
    """
    R, N = parents.shape
    reach = np.zeros((R, N, N), dtype=np.float32)
    r, i = np.nonzero(parents >= 0)
    reach[r, i, parents[r, i]] = 1.0
    reach += np.eye(N, dtype=np.float32)
    steps = 1
    while steps < max_depth:
        reach = np.minimum(reach @ reach, 1.0)
        steps *= 2
    return reach > 0


def tree_attention_inputs(plan: VerifyPlan, block_table: Tensor, block: int, kv_heads: int,
                          group: int) -> TreeAttention:
    Rt, N = plan.rows.shape
    prefix, size = plan.prefix.numpy(), plan.size.numpy()
    columns = int((prefix + size).max())
    nblk = -(-columns // block)
    blocks = block_table[plan.req_index, :nblk].long()
    table = blocks.numpy()
    first = int(table[0, 0]) if Rt == 1 and (nblk == 1 or bool((np.diff(table[0]) == 1).all())) else None
    additive = np.full((Rt, 1 if Rt == 1 else kv_heads, group, N, columns), -np.inf, dtype=np.float32)
    seen = np.where(plan.mask.numpy(), np.float32(0), np.float32(-np.inf))
    for r in range(Rt):  # committed positions, then the tree's nodes under its mask
        p, n = int(prefix[r]), int(size[r])
        additive[r, ..., :p] = 0
        additive[r, ..., p:p + n] = seen[r, :, :n]
    return TreeAttention(first, blocks, columns, torch.from_numpy(additive.reshape(-1, group * N, columns)))


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
    req_index, start, size = (np.ascontiguousarray(a) for a in np.array([c[:3] for c in chosen], dtype=np.int64).T)
    # The deepest node bounds the walk and the ancestor table: a cut tree is often shallower than the drafter's block.
    spec = TreeSpec(tokens=torch.from_numpy(tokens), parents=torch.from_numpy(parents),
                    depths=torch.from_numpy(depths), sizes=torch.from_numpy(size), max_depth=int(depths.max()))
    node = np.arange(N)
    first = chosen[0][1]
    adjacent = all(n == N and row == first + j * N for j, (_, row, n, _) in enumerate(chosen))
    return VerifyPlan(
        req_ids=[c[3] for c in chosen], req_index=torch.from_numpy(req_index), start=torch.from_numpy(start),
        size=spec.sizes, prefix=torch.from_numpy(num_computed[req_index].astype(np.int64)), spec=spec,
        params=[params[c[3]] for c in chosen], seeds=[book.seed(c[3], params[c[3]]) for c in chosen],
        rows=torch.from_numpy(start[:, None] + np.minimum(node, size[:, None] - 1)),
        valid=torch.from_numpy(node < size[:, None]), mask=torch.from_numpy(ancestors(parents, spec.max_depth)),
        row_slice=slice(first, first + Rt * N) if adjacent else None)
