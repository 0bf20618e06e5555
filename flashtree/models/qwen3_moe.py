"""Qwen3-MoE targets (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3 attention, routed-expert MLPs.

Everything but the MLP is the dense Qwen3 transformer. Layer i is sparse when it is not in
`mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`; the others keep a dense
MLP of `intermediate_size`. The experts live in models/moe.py, shared with Qwen3.5-MoE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashtree.models.moe import SparseMoE
from flashtree.models.transformer import Transformer, TransformerArgs


@dataclass
class Qwen3MoeArgs(TransformerArgs):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, config) -> "Qwen3MoeArgs":
        dense = TransformerArgs.from_hf(config)
        return cls(
            **vars(dense),
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=bool(config.norm_topk_prob),
            decoder_sparse_step=getattr(config, "decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(getattr(config, "mlp_only_layers", None) or []),
        )

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


class Qwen3Moe(Transformer):
    compilable = False  # the experts' routing gives data-dependent shapes

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args)
        for i, block in enumerate(self.layers):
            if args.is_moe(i):  # built on the meta device by the loader, so the dense MLP costs nothing
                block.mlp = SparseMoE(args.hidden_size, args.num_experts, args.num_experts_per_tok,
                                      args.moe_intermediate_size, args.norm_topk_prob)
