"""One rank's view of the tensor-parallel group: who it is, where it computes, and the two
collectives the sharded model needs on its hot path (a sum, and a gather along the last dim).

Every rank holds a 1/N slice of the target; the group is torch.distributed's default process
group (NCCL on CUDA, gloo on the CPU), which flashtree.parallel.workers sets up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flashtree.errors import FlashtreeError


@dataclass
class TensorParallel:
    rank: int
    world: int
    device: torch.device

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum over ranks, in place (a row-parallel projection's partial outputs)."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: Tensor, sizes: list[int]) -> Tensor:
        """Every rank's x [..., sizes[rank]] concatenated along the last dim, in rank order.
        Uneven slices are padded to the largest for the collective and trimmed after."""
        width = max(sizes)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's equal share of `total` units (heads, channels, rows)."""
        if total % self.world:
            raise FlashtreeError(f"the target has {total} {what}, which tensor_parallel_size={self.world} "
                                 f"cannot split evenly; use a tensor_parallel_size that divides {total}")
        n = total // self.world
        return self.rank * n, n

    def balanced(self, total: int) -> list[int]:
        """Every rank's share of `total` rows when they need not divide evenly (the vocabulary)."""
        return [(r + 1) * total // self.world - r * total // self.world for r in range(self.world)]
