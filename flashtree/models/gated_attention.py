"""Qwen3.5's full-attention layer: q/k norm, partial RoPE and a sigmoid output gate."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashtree.models.context import ForwardContext
from flashtree.models.compiled import attend
from flashtree.models.layers import Linear, MergedLinear, Rope, apply_rotary
from flashtree.models.qwen3_5_args import Qwen35Args
from flashtree.models.qwen3_5_norms import ZeroCentredRMSNorm


class GatedAttention(nn.Module):
    """Full attention with q/k norm, partial RoPE and a sigmoid output gate from q_proj; q (with its
    gate), k and v come out of one matmul."""

    def __init__(self, args: Qwen35Args, index: int) -> None:
        super().__init__()
        d, hd, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.index = index  # which attention layer: row of the cache's K/V
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, hd
        # q_proj holds each head's query and output gate: [H, 2, hd] rows.
        self.qkv_proj = MergedLinear(d, [("q_proj", args.num_heads * hd * 2), ("k_proj", args.num_kv_heads * hd),
                                         ("v_proj", args.num_kv_heads * hd)], bias=bias)
        self.o_proj = Linear(args.num_heads * hd, d, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(hd, args.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, args.rms_norm_eps)

    def forward(self, x: Tensor, rope: Rope, ctx: ForwardContext) -> Tensor:
        r, n, _ = x.shape
        h, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.qkv_proj(x)
        q, gate = qg.view(r, n, h, 2 * hd).chunk(2, dim=-1)
        k = k.view(r, n, hkv, hd)
        v = v.view(r, n, hkv, hd)
        qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        q, k = apply_rotary(qk, rope).split([h, hkv], dim=2)  # one rotation for q and k
        out = attend(q, k, v, ctx, self.index, hd**-0.5)
        return self.o_proj(out * torch.sigmoid(gate.reshape(r, n, -1)))
