"""Gated DeltaNet (GDN), Qwen3.5's linear-attention layer: a causal depthwise conv over the qkv
projection, then the gated delta rule (flashtree.models.delta_rule) over a [dk, dv] state per head.

In a draft tree each node convolves and recurs along its own ancestor path. The forward reads the
slot's committed conv window and state from the cache but never writes them: it leaves a record in
ctx.windows (a DeltaWindow for a verify window, a WindowEnd for a kept prefill window) and the
cache's commit sets the state and conv window from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashtree.models.context import ForwardContext
from flashtree.models.delta_rule import DeltaWindow, WindowEnd, delta_rule_chunked, delta_rule_window
from flashtree.models.qwen3_5_args import Qwen35Args
from flashtree.models.layers import Linear, MergedLinear
from flashtree.models.qwen3_5_norms import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, args: Qwen35Args, index: int) -> None:
        super().__init__()
        a = args
        self.index = index  # which GDN layer: row of the cache's recurrent state
        self.num_k_heads, self.num_v_heads = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.dk, self.num_v_heads * self.dv
        self.kernel = a.linear_conv_kernel
        conv_dim = a.conv_dim
        # The checkpoint's four input projections as one matmul.
        self.in_proj = MergedLinear(a.hidden_size, [("in_proj_qkv", conv_dim), ("in_proj_z", self.value_dim),
                                                    ("in_proj_b", self.num_v_heads), ("in_proj_a", self.num_v_heads)])
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.dv, a.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, a.hidden_size, bias=False)

    def conv(self, u: Tensor, window: Tensor, ctx: ForwardContext) -> Tensor:
        """silu(causal depthwise conv) of inputs u [R, N, C] after the committed window [R, K-1, C]."""
        ext = torch.cat([window, u], dim=1)  # [R, K-1+N, C]
        w = self.conv1d.weight[:, 0]  # [C, K]
        if ctx.taps is None:  # a chain: each node's taps are the K inputs ending at it
            return F.silu(F.conv1d(ext.transpose(1, 2), w[:, None], groups=w.shape[0])).transpose(1, 2)
        r, n, k = ctx.taps.shape  # a tree: the K inputs on the node's path (ctx builds the index once)
        taps = ext.gather(1, ctx.taps.reshape(r, n * k, 1).expand(-1, -1, ext.shape[2]))
        return F.silu((taps.view(r, n, k, -1) * w.t()).sum(2))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        r, n, _ = x.shape
        cache = ctx.cache
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.dk, self.dv
        u, z, b, a = self.in_proj(x)
        f = cache.state.dtype  # the recurrence runs in float32 (float64 for a float64 model)
        beta = b.sigmoid().to(f).transpose(1, 2)  # [R, H, N]
        g = (F.softplus(a.to(f) + self.dt_bias) * -self.A_log.to(f).exp()).transpose(1, 2)

        window, state = cache.recurrent_state(self.index, ctx)  # [R, K-1, C], [R, H, dk, dv]
        mixed = self.conv(u, window, ctx).to(f)
        # q and k are l2-normalised per head, both at once, in the reference's exact order: the
        # delta rule's solve amplifies any rounding in the keys. q also takes the 1/sqrt(dk) scale.
        qk = mixed[..., : 2 * self.key_dim].view(r, n, 2 * hk, dk)
        qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + L2_EPS)
        q, k = qk.transpose(1, 2).split([hk, hk], dim=1)  # [R, Hk, N, dk]
        q = q * dk**-0.5
        v = mixed[..., 2 * self.key_dim :].view(r, n, hv, dv).transpose(1, 2)
        if hv != hk:  # each q/k head serves consecutive value heads
            q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)

        if ctx.keep_all:
            out, end = delta_rule_chunked(q, k, v, g, beta, state)
            ctx.windows[self.index] = WindowEnd(end, torch.cat([window, u], dim=1)[:, -(self.kernel - 1):])
        else:
            out, deltas, c = delta_rule_window(q, k, v, g, beta, state, ctx.tree_mask)
            ctx.windows[self.index] = DeltaWindow(u, k, deltas, c)

        out = self.norm(out.transpose(1, 2).to(x.dtype), z.view(r, n, hv, dv))
        return self.out_proj(out.reshape(r, n, self.value_dim))


L2_EPS = 1e-6  # the l2 norm's epsilon on the sum of squares (as the checkpoints' reference code has it)
