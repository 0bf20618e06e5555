"""DFlash2 drafter: DFlash-1 plus block-local dynamic convolutions and a Markov candidate selector.

It extends DFlash-1 (models/dflash.py) and keeps everything it has: the same context K/V cache
(fc + hidden_norm over the target's features, projected once per committed token by each layer's
k/v projections, never convolved), the same block `[bonus, MASK x (L-1)]` with bidirectional
attention inside the block, the same final `norm`, and the target's borrowed embedding and LM head.
What it adds, in the layout of z-lab's `DFlash2DraftModel` checkpoints:

Input. The block's embeddings are scaled: `x = embed_tokens(block) * input_embedding_scale`.

Convolutions. Every decoder layer has an `attention_conv` and an `mlp_conv`. Each is a causal,
depthwise convolution over the block's L slots (slot i sees slots i, i-1, .., i-taps+1 of its own
block; the context never enters), with one tap weight per channel and tap:

    w[i, t, c] = base_kernel[side, t, c] + delta[i, side, t, c // conv_group_size]
    conv_side(y)[i, c] = sum_{t < taps, t <= i} w[i, t, c] * y[i - t, c]

`delta = kernel_projection(h)` ([L, 2 * taps * groups], read as [2, taps, groups]) is predicted
from the sublayer's normalised input h at the output slot i, and both sides use the same delta:
side 0 convolves the sublayer input, side 1 its output. A layer is

    h = input_layernorm(x);           d = attention_conv.kernels(h)
    x = x + conv_1(self_attn(conv_0(h, d)), d)        # Q, K and V of the block come from conv_0(h)
    h = post_attention_layernorm(x);  d = mlp_conv.kernels(h)
    x = x + conv_1(mlp(conv_0(h, d)), d)

RMSNorms normalise over the hidden size of one slot, as in DFlash-1. base_kernel = [1, 0, ..] with
delta = 0 is the identity: that layer is DFlash-1's.

Draft logits. `z = lm_head(norm(x))` of slots 1..L-1, then `z = z * output_multiplier`, then, when
`final_logit_softcapping` = c > 0, `z = c * tanh(z / c)`. These are the "unary" logits: with
the selector off they are DFlash-1's per-position marginals (build_tree runs on them).

Selector. Depth l (slot l) keeps the top-K (`selector_top_k`) tokens of z_l as candidates, in the
order (logit desc, token id asc). Candidate c after predecessor p (the bonus token at depth 1, a
candidate of depth l-1 after that) scores

    s_l(p, c) = unary_l(c) + < predecessor_codebook[p] * hidden_projection(h_l), successor_codebook[c] >

with h_l the normed hidden state of slot l. The draft's conditional distribution keeps the
unary mass of the candidate set and shares it out by the selector's scores:

    log q_l(c | p) = log_softmax_c(s_l(p, .))[c] + logsumexp_{c' in top-K} log_softmax_V(z_l)[c']

so with zero codebooks it is exactly DFlash-1's marginal on the candidates (and the tree under it is
build_tree's when K >= B), and scores stay comparable with DFlash-1's (the budget logic reads them).
Tokens outside the top-K are never drafted. The greedy chain takes argmax_c s_l(p, c) depth by depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashtree.errors import FlashtreeError
from flashtree.models.context import ForwardContext
from flashtree.models.dflash import DFlashArgs, DFlashDrafter, DraftBlock, drafter_config
from flashtree.models.layers import Rope

ARCHITECTURE = "DFlash2DraftModel"
SELECTOR_KEYS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")


@dataclass
class DFlash2Args(DFlashArgs):
    selector_rank: int = 32
    selector_top_k: int = 16
    conv_kernel_size: int = 4
    conv_group_size: int = 32
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, config) -> "DFlash2Args":
        """From the drafter's config as transformers reads it; the DFlash2 keys ride along in
        dflash_config (or, as some exports write them, at the top level)."""
        base = DFlashArgs.from_hf(config)
        dcfg = getattr(config, "dflash_config", None) or {}

        def value(name, default=None):  # dflash_config wins, then the top level
            return dcfg.get(name, getattr(config, name, default))

        missing = [k for k in SELECTOR_KEYS if value(k) is None]
        if missing:
            raise FlashtreeError(f"DFlash2 drafter config.json lacks dflash_config.{', '.join(missing)}")
        cap = value("final_logit_softcapping")
        args = cls(**vars(base), selector_rank=int(value("selector_rank")), selector_top_k=int(value("selector_top_k")),
                   conv_kernel_size=int(value("conv_kernel_size")), conv_group_size=int(value("conv_group_size")),
                   input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                   output_multiplier=float(value("output_multiplier", 1.0)),
                   final_logit_softcapping=float(cap) if cap is not None and float(cap) > 0 else None)
        args.check()
        return args

    def check(self) -> None:
        if self.hidden_size % self.conv_group_size:
            raise FlashtreeError(f"DFlash2 conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.conv_kernel_size < 1 or self.selector_rank < 1:
            raise FlashtreeError("DFlash2 conv_kernel_size and selector_rank must be >= 1")
        if not 1 <= self.selector_top_k <= max(1, self.vocab_size):
            raise FlashtreeError(f"DFlash2 selector_top_k {self.selector_top_k} must be in 1..vocab_size ({self.vocab_size})")


class BlockConv(nn.Module):
    """Causal depthwise convolution over the block axis (-2) with input-dependent, per-group taps."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def kernels(self, h: Tensor) -> Tensor:
        """Per-slot tap deltas [..., L, 2, taps, groups] predicted from the sublayer input h [..., L, H]."""
        return self.kernel_projection(h).unflatten(-1, (2, self.taps, self.groups))

    def forward(self, y: Tensor, delta: Tensor, side: int) -> Tensor:
        """Convolve y [..., L, H] along L with base_kernel[side] + delta[..., side]."""
        ys = y.unflatten(-1, (self.groups, self.group_size))  # [..., L, G, gs]
        w = self.base_kernel[side].view(self.taps, self.groups, self.group_size) + delta[..., side, :, :, None]
        # Tap t reads slot l - t: the block padded by taps - 1 zero slots in front and windowed (a
        # view, oldest slot first, so the taps run backwards): one product and one sum for all taps.
        past = F.pad(ys, (0, 0, 0, 0, self.taps - 1, 0)).unfold(-3, self.taps, 1)  # [..., L, G, gs, taps]
        return (past * w.flip(-3).movedim(-3, -1)).sum(-1).flatten(-2)


class DFlash2Block(DraftBlock):
    """A DFlash-1 layer with a convolution around each sublayer (see the module docstring)."""

    def __init__(self, args: DFlash2Args, layer: int) -> None:
        super().__init__(args, layer)
        self.attention_conv = BlockConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = BlockConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def run(self, x: Tensor, attend) -> Tensor:
        """The layer over blocks x [..., L, H], with `attend` mapping the block's attention input to
        its output (inference: one block per row; training: many blocks per sequence)."""
        h = self.input_layernorm(x)
        d = self.attention_conv.kernels(h)
        x = x + self.attention_conv(attend(self.attention_conv(h, d, 0)), d, 1)
        h = self.post_attention_layernorm(x)
        d = self.mlp_conv.kernels(h)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(h, d, 0)), d, 1)

    def forward(self, x: Tensor, rope: Rope, ctx: ForwardContext, mask: Tensor) -> Tensor:
        return self.run(x, lambda h: self.self_attn(h, rope, ctx, mask))


class CandidateSelector(nn.Module):
    """Low-rank bigram term: <pred[p] * proj(h), succ[c]> for predecessor p and candidate c."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def query(self, hidden: Tensor, prev: Tensor) -> Tensor:
        """pred[prev] * proj(hidden): hidden [..., H], prev [..., P] -> [..., P, r] (at least float32)."""
        proj = wide(self.hidden_projection(hidden))
        return wide(self.predecessor_codebook[prev]) * proj[..., None, :]

    def pairwise(self, hidden: Tensor, prev: Tensor, cand: Tensor) -> Tensor:
        """[..., P, K]: the term for every predecessor prev [..., P] and candidate cand [..., K]."""
        return self.query(hidden, prev) @ wide(self.successor_codebook[cand]).transpose(-1, -2)

    def full(self, hidden: Tensor, prev: Tensor) -> Tensor:
        """[..., V]: the term for one predecessor prev [...] and every token (training)."""
        return self.query(hidden, prev[..., None])[..., 0, :] @ wide(self.successor_codebook).T


def wide(x: Tensor) -> Tensor:
    """Half precision up to float32; float32 and float64 stay."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class DFlash2Drafter(DFlashDrafter):
    has_selector = True

    def __init__(self, args: DFlash2Args) -> None:
        super().__init__(args)
        self.layers = nn.ModuleList(DFlash2Block(args, i) for i in range(args.num_layers))
        self.candidate_selector = CandidateSelector(args.hidden_size, args.vocab_size, args.selector_rank)

    def forward(self, noise: Tensor, *context) -> Tensor:
        """Hidden states [R, L, d] of the block embeddings `noise` (unscaled) after each slot's
        context; `context` is what DFlashDrafter.forward takes besides the block."""
        scale = self.args.input_embedding_scale
        return super().forward(noise * scale if scale != 1.0 else noise, *context)

    def logits(self, hidden: Tensor, lm_head: nn.Module) -> Tensor:
        """Unary draft logits: the LM head, times output_multiplier, softcapped."""
        return unary_logits(lm_head(hidden), self.args)

    def transitions(self, hidden: Tensor, logits: Tensor, roots: Tensor) -> tuple[Tensor, Tensor]:
        """Candidates [R, D, K] and log q(c | p) [R, D, K, K] for the D drafted depths.

        hidden [R, D, d] and logits [R, D, V] are slots 1..D; roots [R] the bonus tokens. Row p of
        depth l > 1 conditions on candidate p of depth l-1; at depth 1 every row conditions on the
        root (the tree builder reads row 0 there).
        """
        k = self.args.selector_top_k
        lp = torch.log_softmax(wide(logits), dim=-1)
        cand_lp, cand = top_candidates(lp, k)
        prev = torch.cat([roots.reshape(-1, 1, 1).expand(-1, 1, k), cand[:, :-1]], dim=1)
        score = cand_lp[:, :, None, :] + self.candidate_selector.pairwise(hidden, prev, cand)
        mass = torch.logsumexp(cand_lp, dim=-1)[..., None, None]  # log unary mass of the candidates
        return cand, torch.log_softmax(score, dim=-1) + mass


def unary_logits(z: Tensor, args: DFlash2Args) -> Tensor:
    z = z * args.output_multiplier if args.output_multiplier != 1.0 else z
    cap = args.final_logit_softcapping
    return torch.tanh(z / cap) * cap if cap else z


def top_candidates(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The top-k of x [..., V] by (value desc, index asc), exactly: values and indices.

    torch.topk picks any of several equal values at the k-th place, so the k-th value's ties are
    settled by index (a cumsum), then a second topk on distinct int32 keys gathers the k winners.
    """
    v = x.shape[-1]
    kth = x.topk(k, dim=-1).values[..., -1:]
    above, tied = x > kth, x == kth
    take = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    key = take.to(torch.int32) * (v - torch.arange(v, device=x.device, dtype=torch.int32))
    ids = key.topk(k, dim=-1).indices
    vals, order = x.gather(-1, ids).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, order)


# ---------------------------------------------------------------------------- checkpoints


def load_drafter(name_or_path, target: nn.Module, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    """Load a DFlash-1 or DFlash2 checkpoint (by its `architectures`) and check that it fits `target`."""
    from flashtree.models import dflash
    from flashtree.models.loader import read_config, resolve

    path = resolve(name_or_path)
    config = read_config(path)
    if ARCHITECTURE not in (getattr(config, "architectures", None) or []):
        return dflash.load_drafter(path, target, dtype, device)
    args = DFlash2Args.from_hf(config)
    if args.vocab_size != target.vocab_size:
        raise FlashtreeError(f"DFlash2 drafter vocab_size {args.vocab_size} != target vocab size {target.vocab_size}; "
                             "its codebooks index the target's tokens: use a drafter trained for this target")
    return dflash.build_drafter(DFlash2Drafter, args, path, target, dtype, device)


def dflash2_config(args: DFlash2Args, dtype: torch.dtype = torch.float32) -> dict:
    """config.json in the DFlash2DraftModel layout (DFlash-1's, plus the dflash_config keys)."""
    cfg = drafter_config(args, dtype)
    cfg["architectures"] = [ARCHITECTURE]
    cfg["dflash_config"].update(
        selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
        conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
        input_embedding_scale=args.input_embedding_scale, output_multiplier=args.output_multiplier,
        final_logit_softcapping=args.final_logit_softcapping,
    )
    return cfg


def save_drafter(drafter: DFlashDrafter, out_dir) -> None:
    """Write a drafter directory (config.json + model.safetensors) in its own layout."""
    from flashtree.models import dflash

    if not isinstance(drafter, DFlash2Drafter):
        return dflash.save_drafter(drafter, out_dir)
    dflash.save_drafter(drafter, out_dir, dflash2_config(drafter.args, drafter.fc.weight.dtype))
