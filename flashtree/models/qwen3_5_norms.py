"""Qwen3.5's two norms. Neither is the plain RMSNorm of flashtree.models.layers: one scales by
(1 + weight) with zero-initialised weights, the other normalises GDN outputs and gates them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ZeroCentredRMSNorm(nn.Module):
    """Zero-centred RMSNorm: scales by (1 + weight), in float32, then casts (Qwen3.5's order)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = x.to(torch.promote_types(x.dtype, torch.float32))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the GDN output per value head, then times silu(z): plain weight, not zero-centred."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        f = torch.promote_types(dtype, torch.float32)
        y = x.to(f)
        y = self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (y * F.silu(gate.to(f))).to(dtype)
