"""Qwen3.5 / Qwen3.6 hybrid targets: Gated DeltaNet layers + gated full attention, read top-down.

Most layers are Gated DeltaNet (GDN, flashtree.models.gated_deltanet): a causal depthwise conv over
the qkv projection, then the gated delta rule (flashtree.models.delta_rule), a linear recurrence over
a [dk, dv] state per head, solved in closed form over a whole draft tree. Every few layers is a full
attention layer with an output gate, q/k norm and partial RoPE (flashtree.models.gated_attention).
The MLP is dense (qwen3_5) or top-k routed experts plus a gated shared expert (qwen3_5_moe,
qwen3_next). Module names follow the HF checkpoints (minus the `model.` / `model.language_model.`
prefix) so weights load as they are; Qwen3-Next's packed GDN projections are split on load
(`Qwen35.convert_checkpoint`). The cache (flashtree.cache.HybridCache) holds attention K/V plus
each GDN layer's recurrent state and conv window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashtree.cache import HybridCache
from flashtree.models.context import ForwardContext
from flashtree.models.gated_attention import GatedAttention
from flashtree.models.gated_deltanet import GatedDeltaNet
from flashtree.models.layers import MLP
from flashtree.models.qwen3_5_args import Qwen35Args
from flashtree.models.qwen3_5_norms import ZeroCentredRMSNorm
from flashtree.models.transformer import DecoderLM

__all__ = ["Qwen35", "Qwen35Args"]


class Experts(nn.ModuleList):
    """Routed experts, one SwiGLU MLP each, named as the hub checkpoints store them (experts.E.*_proj)."""

    def __init__(self, num: int, dim: int, hidden: int) -> None:
        super().__init__(MLP(dim, hidden) for _ in range(num))

    def forward(self, x: Tensor, index: Tensor, weight: Tensor) -> Tensor:
        """x [T, d]; index/weight [T, top_k]: each token through its experts, weighted and summed."""
        out = torch.zeros_like(x)
        for e in index.unique().tolist():  # one host sync per MoE layer: plain PyTorch, not a fused kernel
            tok, slot = (index == e).nonzero(as_tuple=True)
            out.index_add_(0, tok, (self[e](x[tok]) * weight[tok, slot, None]).to(out.dtype))
        return out


class Router(nn.Module):
    def __init__(self, num: int, dim: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.weight = nn.Parameter(torch.zeros(num, dim))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = F.linear(x, self.weight).softmax(-1, dtype=torch.promote_types(x.dtype, torch.float32))
        weight, index = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weight = weight / weight.sum(-1, keepdim=True)
        return index, weight.to(x.dtype)


class SparseMoE(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert (qwen3_5_moe)."""

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__()
        d = args.hidden_size
        self.gate = Router(args.num_experts, d, args.num_experts_per_tok, args.norm_topk_prob)
        self.experts = Experts(args.num_experts, d, args.moe_intermediate_size)
        self.shared_expert = MLP(d, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        index, weight = self.gate(flat)
        out = self.experts(flat, index, weight)
        out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, args: Qwen35Args, layer: int) -> None:
        super().__init__()
        self.linear = args.layer_types[layer] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(args, args.gdn_layers.index(layer))
        else:
            self.self_attn = GatedAttention(args, args.attention_layers.index(layer))
        self.mlp = SparseMoE(args) if args.is_moe(layer) else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx: ForwardContext) -> Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, ctx) if self.linear else self.self_attn(h, rope, ctx))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35(DecoderLM):
    def __init__(self, args: Qwen35Args) -> None:
        # Qwen3.5's final norm is zero-centred like its others.
        layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        super().__init__(args, layers, ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps))

    def convert_checkpoint(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """Qwen3-Next packs each key head's q, k, v, z (and b, a) rows together in in_proj_qkvz
        (in_proj_ba); split them into the Qwen3.5 projections this model has."""
        a = self.args
        hk, r = a.linear_num_key_heads, a.linear_num_value_heads // a.linear_num_key_heads
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        out = {}
        for name, w in weights.items():
            if name.endswith("linear_attn.in_proj_qkvz.weight"):
                base = name[: -len("in_proj_qkvz.weight")]
                q, k, v, z = w.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
                out[base + "in_proj_qkv.weight"] = torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)])
                out[base + "in_proj_z.weight"] = z.reshape(-1, w.shape[-1])
            elif name.endswith("linear_attn.in_proj_ba.weight"):
                base = name[: -len("in_proj_ba.weight")]
                b, a_ = w.view(hk, 2 * r, -1).split([r, r], dim=1)
                out[base + "in_proj_b.weight"] = b.reshape(-1, w.shape[-1])
                out[base + "in_proj_a.weight"] = a_.reshape(-1, w.shape[-1])
            else:
                out[name] = w
        return out

    def new_cache(self, num_slots: int, max_len: int) -> HybridCache:
        p, a = self.embed_tokens.weight, self.args
        return HybridCache(len(a.attention_layers), len(a.gdn_layers), num_slots, max_len, a.num_kv_heads, a.head_dim,
                           conv=(a.linear_conv_kernel - 1, a.conv_dim),
                           state=(a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim),
                           dtype=p.dtype, device=p.device)
