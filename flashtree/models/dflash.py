"""DFlash block-diffusion drafter (z-lab checkpoint format).

One pass drafts a whole block. The block is `[bonus, MASK x (L-1)]` at positions
`start .. start+L-1`; its queries attend to the drafter's context (the target's fused
features of every committed token) and to the whole block, with no causal mask. Every layer
projects K/V from the same fused context, so the context K/V are computed once, when tokens
are committed, and cached. The drafter has no embeddings and no LM head: it borrows the
target's, frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from flashtree.cache import KVCache, SlidingDraftCache
from flashtree.errors import FlashtreeError
from flashtree.models.compiled import CompiledDrafter, draft_attend
from flashtree.models.context import ForwardContext
from flashtree.models.layers import MLP, Linear, RMSNorm, Rope, Rotary, apply_rotary, rope_parameters
from flashtree.models.mask import additive, block_mask
from flashtree.models.transformer import Attention


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from 1 to N-3; a single draft layer reads the middle block."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    vocab_size: int
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, config) -> "DFlashArgs":
        """From the drafter's config as transformers reads it (a Qwen3 config); the DFlash fields,
        which transformers does not know, ride along as extra attributes and are read here."""
        dcfg = getattr(config, "dflash_config", None) or {}
        layers = config.num_hidden_layers
        block = dcfg.get("block_size", getattr(config, "block_size", None))
        if block is None:
            raise FlashtreeError("drafter config.json has no block_size (top level or in dflash_config)")
        mask = dcfg.get("mask_token_id", getattr(config, "mask_token_id", None))
        if mask is None:
            raise FlashtreeError("drafter config.json has no dflash_config.mask_token_id")
        num_target = getattr(config, "num_target_layers", None)
        ids = dcfg.get("target_layer_ids")
        if ids is None:
            if num_target is None:
                raise FlashtreeError("drafter config.json needs dflash_config.target_layer_ids or num_target_layers")
            ids = default_target_layer_ids(num_target, layers)
        heads = config.num_attention_heads
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * layers
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            block_size=int(block),
            target_layer_ids=list(ids),
            mask_token_id=int(mask),
            num_target_layers=num_target if num_target is not None else max(ids) + 1,
            vocab_size=getattr(config, "vocab_size", None) or 0,
            rope=rope_parameters(config),
            layer_types=list(layer_types),
            sliding_window=getattr(config, "sliding_window", None),
            attention_bias=bool(getattr(config, "attention_bias", False)),
        )

    @property
    def qk_norm(self) -> bool:
        return True  # DFlash drafters are Qwen3 layers

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer, or None for full attention."""
        if self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


class DraftAttention(Attention):
    """Qwen3 attention projections (q/k/v fused, q/k norms); K/V also come from the cached context.

    The block needs q, k and v (one matmul); the context needs only k and v, which are the
    trailing rows of the fused weight (one matmul over that contiguous slice, no wasted q).
    """

    def kv(self, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor]:
        """Rotated K and V [R, n, Hkv, D] for hidden states x [R, n, d]."""
        r, n, _ = x.shape
        k, v = self.qkv_proj.project(x, "k_proj", "v_proj").view(r, n, 2 * self.num_kv_heads, self.head_dim).chunk(2, 2)
        return apply_rotary(self.k_norm(k), rope), v

    def forward(self, x: Tensor, rope: Rope, ctx: ForwardContext, mask: Tensor) -> Tensor:
        r, n, _ = x.shape
        h, hkv = self.num_heads, self.num_kv_heads
        q, k, v = self.qkv_proj.fused(x).view(r, n, h + 2 * hkv, self.head_dim).split([h, hkv, hkv], dim=2)
        q, k = apply_rotary(torch.cat([self.q_norm(q), self.k_norm(k)], dim=2), rope).split([h, hkv], dim=2)
        return self.o_proj(draft_attend(q, k, v, ctx, self.layer, mask, self.head_dim**-0.5))


class DraftBlock(nn.Module):
    def __init__(self, args: DFlashArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(args, layer)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, rope: Rope, ctx: ForwardContext, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, args: DFlashArgs) -> None:
        super().__init__()
        self.args = args
        self.fc = Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.layers = nn.ModuleList(DraftBlock(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = Rotary(args.head_dim, args.rope)
        self.compiled: CompiledDrafter | None = None  # set by compile_drafter (flashtree.models.compiled)

    @property
    def block_size(self) -> int:
        return self.args.block_size

    def check_target(self, target: nn.Module) -> None:
        """Fail early, with the fix, when this drafter was not made for `target`."""
        a = self.args
        n = target.num_layers
        bad = [i for i in a.target_layer_ids if not 0 <= i < n]
        if bad:
            raise FlashtreeError(
                f"drafter target_layer_ids {a.target_layer_ids} do not fit a target with {n} layers "
                f"(bad: {bad}); use a drafter trained for this target"
            )
        if not 0 <= a.mask_token_id < target.vocab_size:
            raise FlashtreeError(
                f"drafter mask_token_id {a.mask_token_id} is outside the target vocabulary "
                f"(size {target.vocab_size}); set dflash_config.mask_token_id to a token of the target"
            )
        if target.args.hidden_size != a.hidden_size:
            raise FlashtreeError(
                f"drafter hidden_size {a.hidden_size} != target hidden_size {target.args.hidden_size}; "
                "use a drafter trained for this target"
            )

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """Context K/V per slot. Sliding-window layers keep a ring of window + block entries when
        that is shorter than max_len, so their memory does not grow with the context."""
        p = self.fc.weight
        a = self.args
        windows = [a.window(i) for i in range(a.num_layers)]
        longest = max((w for w in windows if w is not None), default=None)
        if longest is not None and longest + a.block_size < max_len:
            return SlidingDraftCache(windows, num_slots, max_len, longest + a.block_size, a.block_size,
                                     a.num_kv_heads, a.head_dim, p.dtype, p.device)
        return KVCache(a.num_layers, num_slots, max_len, a.num_kv_heads, a.head_dim, p.dtype, p.device)

    def add_context(self, ctx: ForwardContext, features: Tensor) -> None:
        """Write the context K/V of target features [R, n, F] at ctx.rows (ForwardContext.block of
        n rows); the caller's `cache.commit(ctx, counts)` says how many of them each slot keeps."""
        x = self.hidden_norm(self.fc(features))
        rope = self.rotary(ctx.rows, x.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(x, rope)
            ctx.cache.write(i, ctx, k, v)

    def forward(self, noise: Tensor, ctx: ForwardContext) -> Tensor:
        """Hidden states [R, L, d] of the block embeddings `noise` after each slot's context
        (ctx: ForwardContext.block of L rows over the drafter's cache)."""
        masks = self.masks(ctx, noise.dtype)
        if self.compiled is not None:
            return self.compiled(noise, ctx, masks)
        return self.stack(noise, ctx, masks)

    def masks(self, ctx: ForwardContext, dtype: torch.dtype) -> list[Tensor]:
        """Each layer's additive block mask, built once per (ring, window) kind of layer."""
        keys = torch.arange(ctx.key_len, device=ctx.positions.device)
        ring = ctx.cache if isinstance(ctx.cache, SlidingDraftCache) else None
        built: dict[tuple[bool, int | None], Tensor] = {}
        masks = []
        for i in range(self.args.num_layers):
            kind = (ring is not None and ring.in_ring(i), self.args.window(i))
            if kind not in built:
                held = ring.ring_positions(ctx) if kind[0] else keys
                built[kind] = additive(block_mask(held, ctx.starts, ctx.positions, kind[1]), dtype)
            masks.append(built[kind])
        return masks

    def stack(self, noise: Tensor, ctx: ForwardContext, masks: list[Tensor]) -> Tensor:
        """The layers and the final norm over the block (what compile_drafter compiles)."""
        rope = self.rotary(ctx.positions, noise.dtype)
        x = noise
        for layer, mask in zip(self.layers, masks):
            x = layer(x, rope, ctx, mask)
        return self.norm(x)


def load_drafter(name_or_path, target: nn.Module, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    """Load a z-lab DFlash checkpoint (streamed in like a target) and check that it fits `target`."""
    from flashtree.models.loader import read_config, resolve

    path = resolve(name_or_path)
    config = read_config(path)
    archs = getattr(config, "architectures", None) or []
    if "DFlashDraftModel" not in archs:
        raise FlashtreeError(f"{path} is not a DFlash drafter (architectures {archs}); expected DFlashDraftModel")
    return build_drafter(DFlashDrafter, DFlashArgs.from_hf(config), path, target, dtype, device)


def build_drafter(cls: type, args, path, target: nn.Module, dtype: torch.dtype, device: torch.device):
    """A drafter of class `cls` built on `meta`, checked against `target`, filled from `path`."""
    from flashtree.models.loader import default_dtype, load_checkpoint, meta_device

    with meta_device(), default_dtype(dtype):
        drafter = cls(args)
    drafter.check_target(target)
    load_checkpoint(drafter, path, torch.device(device))
    drafter.source_dir = path
    return drafter.eval()


def drafter_config(args: DFlashArgs, dtype: torch.dtype = torch.float32) -> dict:
    """config.json in the layout z-lab publishes, readable by transformers 4.57 and 5.x alike."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope["rope_theta"],
        "rope_scaling": None if args.rope.get("rope_type", "default") == "default"
        else {k: v for k, v in args.rope.items() if k != "rope_theta"},
        "attention_bias": args.attention_bias,
        "attention_dropout": 0.0,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "layer_types": list(args.layer_types),
        "sliding_window": args.sliding_window,
        "use_sliding_window": any(t == "sliding_attention" for t in args.layer_types),
        "max_window_layers": args.num_layers,
        "block_size": args.block_size,
        "num_target_layers": args.num_target_layers,
        "dflash_config": {
            "block_size": args.block_size,
            "target_layer_ids": list(args.target_layer_ids),
            "mask_token_id": args.mask_token_id,
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def save_drafter(drafter: DFlashDrafter, out_dir, config: dict | None = None) -> None:
    """Write a z-lab format drafter directory (config.json + model.safetensors), with q/k/v and
    gate/up stored apart as the hub layout has them. config: the config.json to write (default:
    the DFlash-1 layout of drafter.args)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from flashtree.models.loader import hub_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in hub_state_dict(drafter).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = config if config is not None else drafter_config(drafter.args, drafter.fc.weight.dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
