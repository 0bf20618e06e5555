"""Qwen3.5 / Qwen3.6 / Qwen3-Next hyper-parameters, read from the config transformers loads."""

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
    def from_hf(cls, config) -> "Qwen35Args":
        """From the text config transformers reads (Qwen3_5TextConfig, Qwen3_5MoeTextConfig,
        Qwen3NextConfig: loader.read_config unwraps the multimodal layout)."""
        c = config
        layers = c.num_hidden_layers
        types = getattr(c, "layer_types", None)
        if not types:  # a raw config of a type this transformers does not know
            every = getattr(c, "full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
        rope = rope_parameters(c)
        rope.setdefault("partial_rotary_factor", 0.25)  # HF's default for this family
        if rope["rope_type"] == "mrope":
            rope["rope_type"] = "default"  # text positions: all three mrope axes agree, so 1-D RoPE
        heads = c.num_attention_heads

        def opt(key: str, default=0):  # dense configs have no MoE keys; some hold None
            return getattr(c, key, None) or default

        return cls(
            model_type=getattr(c, "model_type", None) or "qwen3_5_text",
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=opt("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=opt("num_key_value_heads", heads),
            head_dim=opt("head_dim", c.hidden_size // heads),
            rms_norm_eps=opt("rms_norm_eps", 1e-6),
            layer_types=list(types),
            linear_conv_kernel=opt("linear_conv_kernel_dim", 4),
            linear_key_head_dim=opt("linear_key_head_dim", 128),
            linear_value_head_dim=opt("linear_value_head_dim", 128),
            linear_num_key_heads=opt("linear_num_key_heads", 16),
            linear_num_value_heads=opt("linear_num_value_heads", 32),
            rope=rope,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            max_position_embeddings=opt("max_position_embeddings", 32768),
            num_experts=opt("num_experts"),
            num_experts_per_tok=opt("num_experts_per_tok"),
            moe_intermediate_size=opt("moe_intermediate_size"),
            shared_expert_intermediate_size=opt("shared_expert_intermediate_size"),
            norm_topk_prob=bool(getattr(c, "norm_topk_prob", True)),
            decoder_sparse_step=opt("decoder_sparse_step", 1),
            mlp_only_layers=list(opt("mlp_only_layers", [])),
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
