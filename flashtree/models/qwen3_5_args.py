"""Qwen3.5 / Qwen3.6 / Qwen3-Next hyper-parameters, read from a config.json of any of their layouts."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashtree.models.layers import rope_parameters


@dataclass
class Qwen35Args:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: list[str]
    linear_conv_kernel: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    # Mixture of experts (qwen3_5_moe, qwen3_next); num_experts == 0 means dense MLPs throughout.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen35Args":
        layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if not types:
            every = cfg.get("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
        rope = rope_parameters(cfg)
        rope.setdefault("partial_rotary_factor", 0.25)  # HF's default for this family
        if rope["rope_type"] == "mrope":
            rope["rope_type"] = "default"  # text positions: all three mrope axes agree, so 1-D RoPE
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=cfg.get("model_type", "qwen3_5_text"),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            layer_types=list(types),
            linear_conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
            linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
            linear_value_head_dim=cfg.get("linear_value_head_dim", 128),
            linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
            linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
            rope=rope,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            num_experts=cfg.get("num_experts", 0) or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) or 0,
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        )

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != "linear_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def conv_dim(self) -> int:
        a = self
        return 2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads * a.linear_value_head_dim
