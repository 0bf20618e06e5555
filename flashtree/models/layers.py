"""Building blocks shared by the target models and the DFlash drafter."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashtree.models.packed import linear
from flashtree.models.tree_attention import tree_attention

if TYPE_CHECKING:
    from flashtree.models.context import ForwardContext


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # One fused kernel on CUDA; in half precision it accumulates in float32 like HF's
        # upcast, and it is bit-exact with it in float32 and float64 (tests/test_kernel_budget.py).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def linear_init(out_features: int, in_features: int, *lead: int, bias: bool = False) -> Tensor:
    """nn.Linear's default init (uniform in +-1/sqrt(fan_in)) for a [*lead, out, in] weight or its bias;
    free on the meta device, where the loader builds models."""
    shape = (*lead, out_features) if bias else (*lead, out_features, in_features)
    bound = 1.0 / math.sqrt(in_features)
    return nn.init.uniform_(torch.empty(shape), -bound, bound)


class Linear(nn.Linear):
    """nn.Linear whose product goes through oneDNN's packed weight once `packed.pack_linears` marks it (CPU)."""

    packed = False

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class MergedLinear(nn.Module):
    """Several projections of the same input as one matmul (q/k/v, gate/up), as gpt-fast fuses them.

    `parts` names each projection as the checkpoint does, relative to this module's parent
    (e.g. ("q_proj", 4096)), with its output size. The weight stacks them along dim 0 in that
    order, so the loader places checkpoint tensor `<parent>.q_proj.weight` at rows
    `offset("q_proj")` (`checkpoint_layout`), and `hub_state` splits it back for writing
    checkpoints. Tensor parallelism shards every part alike: rank r keeps rows
    [r * size / N, (r + 1) * size / N) of each part, so the parts stay in order.
    """

    packed = False  # set by `packed.pack_linears`: products go through oneDNN's packed weight (CPU)

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = [name for name, _ in parts]
        self.sizes = [size for _, size in parts]
        self.weight = nn.Parameter(linear_init(sum(self.sizes), in_features))
        self.bias = nn.Parameter(linear_init(sum(self.sizes), in_features, bias=True)) if bias else None

    def offset(self, part: str) -> slice:
        """The rows of `part` in the stacked weight."""
        i = self.parts.index(part)
        start = sum(self.sizes[:i])
        return slice(start, start + self.sizes[i])

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        """Every part's output, split from one matmul (views of one tensor)."""
        return self.fused(x).split(self.sizes, dim=-1)

    def fused(self, x: Tensor) -> Tensor:
        """All parts side by side, as one tensor (in `parts` order)."""
        return linear(x, self.weight, self.bias, self.packed)

    def project(self, x: Tensor, first: str, last: str | None = None) -> Tensor:
        """Only the consecutive parts first..last, one matmul over their rows (a contiguous slice)."""
        rows = slice(self.offset(first).start, self.offset(last or first).stop)
        return linear(x, self.weight, self.bias, self.packed, rows)

    def checkpoint_layout(self, prefix: str) -> dict[str, tuple[str, tuple]]:
        """Checkpoint name -> (own parameter, index) for each part; `prefix` is this module's name
        with its dot, and the parts are stored beside it (`...self_attn.q_proj.weight`)."""
        parent = prefix[: prefix[:-1].rfind(".") + 1]
        out = {}
        for part in self.parts:
            rows = self.offset(part)
            out[f"{parent}{part}.weight"] = ("weight", (rows,))
            if self.bias is not None:
                out[f"{parent}{part}.bias"] = ("bias", (rows,))
        return out

    def hub_state(self, prefix: str) -> dict[str, Tensor]:
        """The parts under the checkpoint's names (the inverse of `checkpoint_layout`), for writing."""
        return {name: getattr(self, attr)[index] for name, (attr, index) in self.checkpoint_layout(prefix).items()}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, parts={dict(zip(self.parts, self.sizes))}, bias={self.bias is not None}"


class MLP(nn.Module):
    """SwiGLU feed-forward block (Llama / Qwen), gate and up fused into one matmul."""

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(dim, [("gate_proj", hidden), ("up_proj", hidden)], bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


def rope_parameters(config) -> dict:
    """RoPE settings of a transformers config (or a raw config.json dict), in either layout.

    transformers 5.x standardises every config to `rope_parameters`; 4.x and many hub files
    write `rope_theta` + `rope_scaling` at the top level. A raw dict (a model type the installed
    transformers does not know) can hold either, so both are read.
    """
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    params = {**(get("rope_scaling") or {}), **(get("rope_parameters") or {})}
    if "rope_theta" not in params:
        params["rope_theta"] = get("rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if "partial_rotary_factor" not in params and get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = get("partial_rotary_factor")
    return params


def inv_frequencies(head_dim: int, params: dict) -> Tensor:
    """Inverse RoPE frequencies for the supported scaling types (default, linear, llama3)."""
    rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    base = float(params["rope_theta"])
    # float32 throughout, as HF computes it, so logits match bit for bit where they can.
    # On the CPU explicitly: models are built on the meta device, and these are not weights to load.
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim))
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


class Rope(NamedTuple):
    """One forward's rotation, shared by every layer: x -> x * cos + swap(x) * sin.

    cos and sin are [R, N, 1, D] (D = head dim): on rotated channels cos and the signed sin
    (-sin on the first half, +sin on the second), on channels partial RoPE leaves alone 1 and 0.
    `swap` exchanges the rotated halves (None: a roll by D/2, when every channel rotates).
    """

    cos: Tensor
    sin: Tensor
    swap: Tensor | None


class Rotary(nn.Module):
    """The Rope for arbitrary (tree) positions, computed once per forward from the positions.

    The frequencies are kept in float32 outside the state dict, so casting the model to
    bf16 does not round them, and a model built on the meta device still has them (on the
    CPU; the first forward moves them to the positions' device).
    """

    def __init__(self, head_dim: int, params: dict) -> None:
        super().__init__()
        self._inv_freq = inv_frequencies(head_dim, params)
        self.head_dim = head_dim
        rot = 2 * self._inv_freq.shape[0]
        self._pass = head_dim - rot
        half = torch.arange(rot // 2, device="cpu")
        rest = torch.arange(rot, head_dim, device="cpu")
        self._swap = None if self._pass == 0 else torch.cat([half + rot // 2, half, rest])

    def forward(self, positions: Tensor, dtype: torch.dtype) -> Rope:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
            self._swap = None if self._swap is None else self._swap.to(positions.device)
        freqs = positions.float()[..., None] * self._inv_freq  # [R, N, D_rot / 2]
        cos, sin = freqs.cos(), freqs.sin()
        parts_cos, parts_sin = [cos, cos], [-sin, sin]
        if self._pass:
            parts_cos.append(torch.ones_like(freqs[..., :1]).expand(*freqs.shape[:-1], self._pass))
            parts_sin.append(torch.zeros_like(freqs[..., :1]).expand(*freqs.shape[:-1], self._pass))
        return Rope(torch.cat(parts_cos, -1).to(dtype)[..., None, :], torch.cat(parts_sin, -1).to(dtype)[..., None, :],
                    self._swap)


def apply_rotary(x: Tensor, rope: Rope) -> Tensor:
    """Rotate x [R, N, H, D] (heads third, as projections come out) in three kernels."""
    swapped = x.roll(x.shape[-1] // 2, -1) if rope.swap is None else x.index_select(-1, rope.swap)
    return torch.addcmul(x * rope.cos, swapped, rope.sin)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool = False) -> Tensor:
    """SDPA over q [R,H,N,D] and k/v [R,Hkv,S,D]; mask [R,1,N,S] is additive (0 or -inf) in q's
    dtype, built once per forward, or a CausalBias (a causal window after a prefix, over exactly
    its keys), or None: every key visible, or with `causal` SDPA's own causal mask (N == S). The
    last three are flash-eligible calls."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def window_attention(q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext, layer: int, scale: float) -> Tensor:
    """Write the window's k/v [R, N, Hkv, D] to cache layer `layer`, then attend q [R, N, H, D] over
    each slot's keys as ctx says: one SDPA over the cache rows, or for a tree with `ctx.tree_parts`
    the committed rows and the window's own k/v merged by LSE. Returns [R, H, N, D]."""
    ctx.cache.write(layer, ctx, k, v)
    if ctx.tree_parts is not None:
        keys, values = ctx.cache.read(layer, ctx, ctx.tree_parts.prefix_len)
        return tree_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keys, values,
                              ctx.tree_parts, scale)
    keys, values = ctx.cache.read(layer, ctx)
    return attention(q.transpose(1, 2), keys, values, ctx.attn_bias, scale, ctx.causal)
