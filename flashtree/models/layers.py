"""Building blocks shared by the target models and the DFlash drafter."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Half precision: normalise in float32 and cast back before the weight, as HF does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward block (Llama / Qwen)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_parameters(cfg: dict) -> dict:
    """RoPE settings from a config.json in either layout.

    transformers 4.x writes `rope_theta` + `rope_scaling` at the top level; 5.x writes
    `rope_parameters`. Both occur on the hub, so both are read.
    """
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    if "partial_rotary_factor" not in params and "partial_rotary_factor" in cfg:
        params["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    return params


def inv_frequencies(head_dim: int, params: dict) -> Tensor:
    """Inverse RoPE frequencies for the supported scaling types (default, linear, llama3)."""
    rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    base = float(params["rope_theta"])
    # float32 throughout, as HF computes it, so logits match bit for bit where they can.
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_type {kind!r}; flashtree supports 'default', 'linear' and 'llama3'"
    )


class Rotary(nn.Module):
    """cos/sin for arbitrary (tree) positions, computed per forward from the positions.

    The frequencies are kept in float32 outside the state dict, so casting the model to
    bf16 does not round them.
    """

    def __init__(self, head_dim: int, params: dict) -> None:
        super().__init__()
        self._inv_freq = inv_frequencies(head_dim, params)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * self._inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] channels of x [R, H, N, D]; the rest pass (partial RoPE)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """SDPA over q [R,H,N,D] and k/v [R,Hkv,S,D] with a boolean mask [R,1,N,S] (True = visible)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
