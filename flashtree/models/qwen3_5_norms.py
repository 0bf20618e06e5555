"""Qwen3.5's two norms. Neither is the plain RMSNorm of flashtree.models.layers: one scales by
(1 + weight) with zero-initialised weights, the other normalises GDN outputs and gates them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ZeroCentredRMSNorm(nn.Module):
    """Zero-centred RMSNorm: scales by (1 + weight). In half precision as y + y * weight, so the
    weights, which sit near 0, are never rounded as 1 + w; in float32/64 exactly HF's y * (1 + w)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, self.weight.shape, 1.0 + self.weight, self.eps)
        y = F.rms_norm(x, self.weight.shape, eps=self.eps)
        return torch.addcmul(y, y, self.weight)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the GDN output per value head, then times silu(z): plain weight, not zero-centred."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps) * F.silu(gate)
