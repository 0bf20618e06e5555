"""Qwen3.5 / Qwen3.6 hybrid targets: Gated DeltaNet layers + gated full attention, read top-down.

Most layers are Gated DeltaNet (GDN, flashtree.models.gated_deltanet): a causal depthwise conv over
the qkv projection, then the gated delta rule (flashtree.models.delta_rule), a linear recurrence over
a [dk, dv] state per head, solved in closed form over a whole draft tree. Every few layers is a full
attention layer with an output gate, q/k norm and partial RoPE (flashtree.models.gated_attention).
The MLP is dense (qwen3_5) or top-k routed experts plus a gated shared expert (qwen3_5_moe,
qwen3_next; flashtree.models.moe). Module names follow the HF checkpoints (minus the `model.` /
`model.language_model.` prefix), with q/k/v and gate/up fused (`MergedLinear`, packed by the
loader); Qwen3-Next's packed GDN projections are split on load (`Qwen35.convert_checkpoint`).
The cache (flashtree.cache.HybridCache) holds attention K/V plus each GDN layer's recurrent state
and conv window.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashtree.cache import HybridCache
from flashtree.models.context import ForwardContext
from flashtree.models.gated_attention import GatedAttention
from flashtree.models.gated_deltanet import GatedDeltaNet
from flashtree.models.layers import MLP, Rope
from flashtree.models.moe import SparseMoE
from flashtree.models.qwen3_5_args import Qwen35Args
from flashtree.models.qwen3_5_norms import ZeroCentredRMSNorm
from flashtree.models.transformer import DecoderLM

__all__ = ["Qwen35", "Qwen35Args"]


class Block(nn.Module):
    def __init__(self, args: Qwen35Args, layer: int) -> None:
        super().__init__()
        self.linear = args.layer_types[layer] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(args, args.gdn_layers.index(layer))
        else:
            self.self_attn = GatedAttention(args, args.attention_layers.index(layer))
        if args.is_moe(layer):
            self.mlp = SparseMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
                                 args.norm_topk_prob, args.shared_expert_intermediate_size)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, rope: Rope, ctx: ForwardContext) -> Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, ctx) if self.linear else self.self_attn(h, rope, ctx))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35(DecoderLM):
    def __init__(self, args: Qwen35Args) -> None:
        # Qwen3.5's final norm is zero-centred like its others.
        layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        super().__init__(args, layers, ZeroCentredRMSNorm(args.hidden_size, args.rms_norm_eps))

    def convert_checkpoint(self, name: str, w: Tensor) -> dict[str, Tensor]:
        """One checkpoint tensor -> the tensors of this model's layout it stands for (the loader calls
        it per tensor). Qwen3-Next packs each key head's q, k, v, z (and b, a) rows together in
        in_proj_qkvz (in_proj_ba); they are split into the Qwen3.5 projections this model has."""
        a = self.args
        hk, r = a.linear_num_key_heads, a.linear_num_value_heads // a.linear_num_key_heads
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            base = name[: -len("in_proj_qkvz.weight")]
            q, k, v, z = w.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
            return {base + "in_proj_qkv.weight": torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)]),
                    base + "in_proj_z.weight": z.reshape(-1, w.shape[-1])}
        if name.endswith("linear_attn.in_proj_ba.weight"):
            base = name[: -len("in_proj_ba.weight")]
            b, a_ = w.view(hk, 2 * r, -1).split([r, r], dim=1)
            return {base + "in_proj_b.weight": b.reshape(-1, w.shape[-1]),
                    base + "in_proj_a.weight": a_.reshape(-1, w.shape[-1])}
        return {name: w}

    def new_cache(self, num_slots: int, max_len: int) -> HybridCache:
        p, a = self.embed_tokens.weight, self.args
        return HybridCache(len(a.attention_layers), len(a.gdn_layers), num_slots, max_len, a.num_kv_heads, a.head_dim,
                           conv=(a.linear_conv_kernel - 1, a.conv_dim),
                           state=(a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim),
                           dtype=p.dtype, device=p.device)
