"""Dense decoder-only targets: Qwen3 and Llama (2/3), read top-down like gpt-fast.

One forward covers prefill, a decode step and tree verification: the window's tokens are
written after each slot's committed prefix and attend to that prefix plus their ancestors.
Module names follow the HF checkpoints (minus the `model.` prefix); q/k/v and gate/up are fused
(`MergedLinear`), and the loader packs the checkpoint's separate tensors into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from flashtree.cache import KVCache
from flashtree.models.context import ForwardContext
from flashtree.models.compiled import CompiledStack, attend
from flashtree.models.layers import MLP, Linear, MergedLinear, RMSNorm, Rope, Rotary, apply_rotary, rope_parameters


@dataclass
class TransformerArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf(cls, config) -> "TransformerArgs":
        """From a transformers config (AutoConfig of the checkpoint; see loader.read_config)."""
        model_type = getattr(config, "model_type", None) or "llama"
        heads = config.num_attention_heads
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            rope=rope_parameters(config),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            max_position_embeddings=getattr(config, "max_position_embeddings", 4096),
        )


class Attention(nn.Module):
    def __init__(self, args: TransformerArgs, layer: int) -> None:
        super().__init__()
        d, hd, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, hd
        self.qkv_proj = MergedLinear(d, [("q_proj", args.num_heads * hd), ("k_proj", args.num_kv_heads * hd),
                                         ("v_proj", args.num_kv_heads * hd)], bias=bias)
        self.o_proj = Linear(args.num_heads * hd, d, bias=bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.rms_norm_eps)
            self.k_norm = RMSNorm(hd, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, rope: Rope, ctx: ForwardContext) -> Tensor:
        r, n, _ = x.shape
        h, hkv = self.num_heads, self.num_kv_heads
        qk, v = self.qkv_proj.fused(x).view(r, n, h + 2 * hkv, self.head_dim).split([h + hkv, hkv], dim=2)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, :h]), self.k_norm(qk[:, :, h:])], dim=2)
        q, k = apply_rotary(qk, rope).split([h, hkv], dim=2)  # one rotation for q and k
        return self.o_proj(attend(q, k, v, ctx, self.layer, self.head_dim**-0.5))


class Block(nn.Module):
    def __init__(self, args: TransformerArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, rope: Rope, ctx: ForwardContext) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ForwardOutput:
    logits: Tensor  # [R, N or 1, V]
    features: Tensor | None  # [R, N, len(feature_layers) * hidden]


class DecoderLM(nn.Module):
    """Embeddings, a stack of blocks, the final norm and the LM head: what every target shares.

    Subclasses build `layers`; every block gets the forward's ForwardContext.
    """

    # Whether compile_stack may compile the stack: every layer's attention goes through `attend`,
    # and nothing else in it reads the context or has data-dependent shapes.
    compilable = False

    def __init__(self, args, layers: nn.ModuleList, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = norm if norm is not None else RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(args.head_dim, args.rope)
        self.compiled: CompiledStack | None = None  # set by compile_stack (flashtree.models.compiled)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    def forward(self, tokens: Tensor, ctx: ForwardContext, feature_layers: tuple[int, ...] = (),
                last_only: bool = False) -> ForwardOutput:
        """Run a window of tokens [R, N] (ctx says where: rows, positions, mask, tree).

        Features are the outputs of the blocks in `feature_layers` (HF hidden_states[k+1]),
        concatenated in that order. The forward writes the window's K/V (and recurrent layers
        their ctx.windows records); `cache.commit(ctx, ...)` decides what of it to keep.
        """
        if self.compiled is not None and self.compiled.covers(feature_layers):
            x, features = self.compiled(tokens, ctx, feature_layers)
        else:
            x, features = self.blocks(tokens, ctx, feature_layers)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(x)
        feats = torch.cat(features, dim=-1) if feature_layers else None
        return ForwardOutput(logits, feats)

    def blocks(self, tokens: Tensor, ctx: ForwardContext, feature_layers: tuple[int, ...]
               ) -> tuple[Tensor, list[Tensor]]:
        """The embeddings, the stack and the final norm (fused into the compiled stack, not one more eager
        op a forward): the normed last output, and the features (the blocks' outputs) in order."""
        x = self.embed_tokens(tokens)
        rope = self.rotary(ctx.positions, x.dtype)
        features: list[Tensor] = [x] * len(feature_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, ctx)
            for j, k in enumerate(feature_layers):
                if k == i:  # one by one, not `i in feature_layers`: dynamo mis-traces that on symbolic ints
                    features[j] = x
        return self.norm(x), features


class Transformer(DecoderLM):
    compilable = True

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__(args, nn.ModuleList(Block(args, i) for i in range(args.num_layers)))

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        a = self.args
        return KVCache(a.num_layers, num_slots, max_len, a.num_kv_heads, a.head_dim, p.dtype, p.device)
