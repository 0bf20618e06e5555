"""The DFlash training forward: every anchored block of a sequence in ONE drafter pass.

A block anchored at position `a` is `[token at a, MASK x (B-1)]` at positions a..a+B-1,
exactly the block the engine drafts after committing a tokens with bonus token ids[a]. Its
queries see (1) the target's fused features of context positions STRICTLY before a, and
(2) the B slots of their own block, bidirectionally; never another block. Slot k predicts
the token at a+k. These are the two places where a public reproduction lost most of its
acceptance (a `<=` for the `<`, and labels shifted by one), so both live here, in one
place, and the tests pin them.

Three attention paths compute the same thing:
- `flex`: FlexAttention with a block-sparse mask (CUDA); cost ~ what the mask keeps.
- `split`: the context part and the per-block part as two small score tensors under one
  softmax; plain matmuls, the fast path on CPU.
- `dense`: SDPA over all blocks with a boolean mask; the simple reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashtree.models.dflash import DFlashDrafter
from flashtree.models.dflash2 import DFlash2Block, DFlash2Drafter, top_candidates, unary_logits
from flashtree.models.layers import apply_rotary

BACKENDS = ("auto", "flex", "split", "dense")
IGNORE = -100


def default_gamma(block_size: int) -> float:
    """Loss-weight decay length: 7 for B = 16 (the paper's value), scaled with B."""
    return 7.0 * block_size / 16


def slot_weights(block_size: int, gamma: float | None = None) -> Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1: early slots gate every later one."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def anchor_candidates(loss_mask: Tensor) -> Tensor:
    """Positions that may open a block: a response token followed by another one.

    The engine's bonus token is always target-written, so the anchor must be a response
    token; and a block whose slot 1 has no label teaches nothing.
    """
    if len(loss_mask) < 2:
        return torch.zeros(0, dtype=torch.long)
    ok = loss_mask[:-1] & loss_mask[1:]
    ok[0] = False  # the drafter always has some context
    return ok.nonzero().flatten()


def sample_anchors(loss_mask: Tensor, max_anchors: int, generator: torch.Generator | None = None) -> Tensor:
    """Up to `max_anchors` distinct candidate positions, uniformly, sorted (redrawn every step)."""
    cand = anchor_candidates(loss_mask)
    if len(cand) > max_anchors:
        pick = torch.randperm(len(cand), generator=generator)[:max_anchors]
        cand = cand[pick.sort().values]
    return cand


@dataclass
class BlockBatch:
    """S sequences padded to T tokens, each with up to m anchors padded (valid = False)."""

    input_ids: Tensor  # [S, T]
    loss_mask: Tensor  # [S, T] bool
    lengths: Tensor  # [S]
    anchors: Tensor  # [S, m]; padding anchors are 0
    valid: Tensor  # [S, m] bool
    features: Tensor | None  # [S, T, F]

    def to(self, device: torch.device) -> "BlockBatch":
        f = None if self.features is None else self.features.to(device)
        return BlockBatch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device),
                          self.anchors.to(device), self.valid.to(device), f)


def make_batch(rows: list, max_anchors: int, generator: torch.Generator | None = None) -> BlockBatch:
    """Pad FeatureRows into one batch and draw each sequence's anchors."""
    s, t = len(rows), max(len(r.input_ids) for r in rows)
    anchors = [sample_anchors(r.loss_mask, max_anchors, generator) for r in rows]
    m = max(1, max(len(a) for a in anchors))
    ids = torch.zeros(s, t, dtype=torch.long)
    mask = torch.zeros(s, t, dtype=torch.bool)
    anc = torch.zeros(s, m, dtype=torch.long)
    valid = torch.zeros(s, m, dtype=torch.bool)
    feats = None
    if rows[0].features is not None:
        feats = torch.zeros(s, t, rows[0].features.shape[-1], dtype=rows[0].features.dtype)
    for i, (r, a) in enumerate(zip(rows, anchors)):
        n = len(r.input_ids)
        ids[i, :n], mask[i, :n] = r.input_ids, r.loss_mask
        anc[i, : len(a)], valid[i, : len(a)] = a, True
        if feats is not None:
            feats[i, :n] = r.features
    lengths = torch.tensor([len(r.input_ids) for r in rows])
    return BlockBatch(ids, mask, lengths, anc, valid, feats)


def block_tokens(input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """[S, m, B]: the anchor's own token, then B-1 mask tokens."""
    tokens = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    tokens[..., 0] = input_ids.gather(1, anchors)
    return tokens


def block_prev_tokens(input_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """[S, m, B-1]: the TRUE token before each labelled slot (slot k: the token at anchor + k - 1).

    The selector is trained teacher-forced on it: at inference slot k's predecessor is the draft's
    own depth k-1 token, which equals this one exactly when the walk reaches slot k.
    """
    t = input_ids.shape[1]
    pos = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)
    return input_ids.gather(1, pos.clamp(max=t - 1).flatten(1)).view_as(pos)


def block_labels(batch: BlockBatch, block_size: int) -> Tensor:
    """[S, m, B-1]: column k-1 holds the token at anchor + k (IGNORE where it must not count).

    Only response tokens inside the sequence count, and only for real anchors.
    """
    s, t = batch.input_ids.shape
    pos = batch.anchors[..., None] + torch.arange(1, block_size, device=batch.anchors.device)  # [S, m, B-1]
    inside = pos < batch.lengths[:, None, None]
    flat = pos.clamp(max=t - 1).flatten(1)
    tokens = batch.input_ids.gather(1, flat).view_as(pos)
    counted = batch.loss_mask.gather(1, flat).view_as(pos) & inside & batch.valid[..., None]
    return torch.where(counted, tokens, torch.full_like(tokens, IGNORE))


# ---------------------------------------------------------------------------- attention


def context_visible(anchors: Tensor, block_size: int, t: int, window: int | None) -> Tensor:
    """[S, m*B, T]: query (block j, slot i) sees context key p iff p < anchor_j (and in window)."""
    keys = torch.arange(t, device=anchors.device)
    qa = anchors.repeat_interleave(block_size, dim=1)  # anchor of every query
    vis = keys[None, None, :] < qa[:, :, None]
    if window is not None:
        slot = torch.arange(block_size, device=anchors.device).repeat(anchors.shape[1])
        vis = vis & ((qa + slot)[:, :, None] - keys[None, None, :] < window)
    return vis


def dense_mask(anchors: Tensor, block_size: int, t: int, window: int | None) -> Tensor:
    """[S, 1, m*B, T + m*B]: the context part, then own-block-only over all blocks."""
    n = anchors.shape[1] * block_size
    blk = torch.arange(n, device=anchors.device) // block_size
    own = (blk[:, None] == blk[None, :]).expand(anchors.shape[0], -1, -1)
    return torch.cat([context_visible(anchors, block_size, t, window), own], dim=2)[:, None]


def dense_attention(q, ck, cv, bk, bv, mask: Tensor, block_size: int, scale: float) -> Tensor:
    keys, values = torch.cat([ck, bk], dim=2), torch.cat([cv, bv], dim=2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=keys.shape[1] != q.shape[1])


def split_attention(q, ck, cv, bk, bv, visible: Tensor, block_size: int, scale: float) -> Tensor:
    """Scores against the context [.., m*B, T] and within each block [.., m, B, B], one softmax."""
    s, h, n, d = q.shape
    kv, t, b = ck.shape[1], ck.shape[2], block_size
    m, g = n // b, h // kv
    qg = q.view(s, kv, g, n, d) * scale
    sc = torch.einsum("skgqd,sktd->skgqt", qg, ck)
    sc = sc.masked_fill(~visible[:, None, None], float("-inf"))
    sb = torch.einsum("skgmid,skmjd->skgmij", qg.view(s, kv, g, m, b, d), bk.view(s, kv, m, b, d))
    p = torch.softmax(torch.cat([sc.view(s, kv, g, m, b, t), sb], dim=-1), dim=-1)
    out = torch.einsum("skgmit,sktd->skgmid", p[..., :t], cv)
    out = out + torch.einsum("skgmij,skmjd->skgmid", p[..., t:], bv.view(s, kv, m, b, d))
    return out.reshape(s, h, n, d)


_flex = None


def flex_mask(anchors: Tensor, block_size: int, t: int, window: int | None):
    """The DFlash mask as a FlexAttention BlockMask over keys [context (T) ; all blocks]."""
    from torch.nn.attention.flex_attention import create_block_mask

    s, n = anchors.shape[0], anchors.shape[1] * block_size
    qa = anchors.repeat_interleave(block_size, dim=1)
    win = window if window is not None else 1 << 30

    def mask_mod(bi, hi, qi, ki):
        a = qa[bi, qi]
        ctx = (ki < t) & (ki < a) & (a + qi % block_size - ki < win)
        own = (ki >= t) & ((ki - t) // block_size == qi // block_size)
        return ctx | own

    return create_block_mask(mask_mod, s, None, n, t + n, device=anchors.device)


def flex_attention(q, ck, cv, bk, bv, mask, block_size: int, scale: float) -> Tensor:
    global _flex
    from torch.nn.attention.flex_attention import flex_attention as flex

    if _flex is None:
        _flex = torch.compile(flex, dynamic=True) if q.is_cuda else flex
    keys, values = torch.cat([ck, bk], dim=2), torch.cat([cv, bv], dim=2)
    return _flex(q, keys, values, block_mask=mask, scale=scale, enable_gqa=keys.shape[1] != q.shape[1])


def pick_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}")
    if backend == "auto":
        return "flex" if device.type == "cuda" and has_flex() else "split"
    return backend


def has_flex() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:  # torch < 2.5
        return False
    return True


# backend -> (mask builder, attention); the mask is built once per forward and window.
ATTENTION = {
    "dense": (dense_mask, dense_attention),
    "split": (context_visible, split_attention),
    "flex": (flex_mask, flex_attention),
}


class BlockDrafter(nn.Module):
    """A DFlashDrafter (or DFlash2Drafter) run over many blocks at once with the training mask.

    It reuses the drafter's own modules (fc, hidden_norm, layers, norm, rotary; a DFlash2 layer's
    convolutions run per block through DFlash2Block.run), so what it trains is exactly what
    `flashtree.LLM` later loads.
    """

    def __init__(self, drafter: DFlashDrafter, backend: str = "auto") -> None:
        super().__init__()
        self.drafter = drafter
        self.backend = backend

    def forward(self, features: Tensor, noise: Tensor, anchors: Tensor) -> Tensor:
        """Hidden states [S, m, B, d] for block embeddings `noise` [S, m, B, d].

        features [S, T, F] are the target's features for context positions 0..T-1.
        """
        dr = self.drafter
        s, m, b, d = noise.shape
        t = features.shape[1]
        backend = pick_backend(self.backend, noise.device)
        ctx = dr.hidden_norm(dr.fc(features.to(noise.dtype)))
        ctx_rope = dr.rotary(torch.arange(t, device=noise.device)[None].expand(s, -1), noise.dtype)
        positions = (anchors[..., None] + torch.arange(b, device=noise.device)).view(s, m * b)
        rope = dr.rotary(positions, noise.dtype)
        scale = getattr(dr.args, "input_embedding_scale", 1.0)
        x = noise.reshape(s, m * b, d) * scale if scale != 1.0 else noise.reshape(s, m * b, d)
        make_mask, attend = ATTENTION[backend]
        masks: dict = {}
        for i, layer in enumerate(dr.layers):
            window = dr.args.window(i)
            if window not in masks:
                masks[window] = make_mask(anchors, b, t, window)
            attn = layer.self_attn

            def attention(h: Tensor) -> Tensor:  # [S, m*B, d] -> [S, m*B, d]
                q = attn.q_norm(attn.qkv_proj.project(h, "q_proj").view(s, m * b, attn.num_heads, attn.head_dim))
                q = apply_rotary(q, rope).transpose(1, 2)
                bk, bv = attn.kv(h, rope)
                ck, cv = attn.kv(ctx, ctx_rope)
                out = attend(q, ck.transpose(1, 2), cv.transpose(1, 2), bk.transpose(1, 2), bv.transpose(1, 2),
                             masks[window], b, attn.head_dim**-0.5)
                return attn.o_proj(out.transpose(1, 2).reshape(s, m * b, -1))

            if isinstance(layer, DFlash2Block):  # convolutions run along each block's own slots
                blocks = lambda h: attention(h.reshape(s, m * b, d)).view(s, m, b, d)
                x = layer.run(x.view(s, m, b, d), blocks).view(s, m * b, d)
            else:
                x = x + attention(layer.input_layernorm(x))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        return dr.norm(x).view(s, m, b, d)


@dataclass
class LossOutput:
    loss: Tensor
    tokens: int  # labelled slots
    blocks: int  # blocks with a label at slot 1
    accept_sum: float  # sum over blocks of 1 + leading run of the chain's hits
    inv_accept_sum: float  # sum over blocks of 1 / (1 + leading run)
    unary_loss: float = 0.0  # the marginal CE (DFlash-1's loss)
    selector_loss: float = 0.0  # the CE of unary + pairwise scores, teacher-forced (DFlash2 only)

    @property
    def tau_estimate(self) -> float:
        """Harmonic mean of per-block acceptance: what the engine's tokens-per-round sees.

        The engine spends one round per accept, so easy stretches (long accepts) count once per
        round, not once per position; the plain mean over anchors overstates tau.
        """
        return self.blocks / max(self.inv_accept_sum, 1e-9)


def block_loss(hidden: Tensor, labels: Tensor, lm_head: nn.Module, weights: Tensor,
               drafter: DFlashDrafter | None = None, prev: Tensor | None = None) -> LossOutput:
    """Slot-weighted CE over labelled slots 1..B-1; the LM head runs on those rows only.

    A DFlash2 drafter (with `prev` from block_prev_tokens) adds the selector's CE: the scores
    unary(c) + <pred[prev] * proj(h), succ[c]> over the whole vocabulary, on the TRUE previous
    token. The pairwise term reads only that token and the slot's hidden state, never the label.
    Its chain hits are the greedy selector chain's (argmax of those scores over the top-K).
    """
    h = hidden[:, :, 1:]  # slot 0 holds the anchor token itself: no label
    keep = labels != IGNORE
    w = weights.to(h.device).expand_as(labels)[keep]
    hk = h[keep]
    logits = lm_head(hk).float()
    selector = isinstance(drafter, DFlash2Drafter)
    if selector:
        logits = unary_logits(logits, drafter.args)
    target = labels[keep]

    def weighted_ce(z: Tensor) -> Tensor:
        return (F.cross_entropy(z, target, reduction="none") * w).sum() / w.sum().clamp(min=1e-6)

    unary = weighted_ce(logits)
    loss, pick, pair_loss = unary, None, 0.0
    if selector:
        scores = logits + drafter.candidate_selector.full(hk, prev[keep])
        pair = weighted_ce(scores)
        loss, pair_loss = unary + pair, pair.item()
        with torch.no_grad():
            cand = top_candidates(logits, drafter.args.selector_top_k)[1]
            pick = cand.gather(-1, scores.gather(-1, cand).argmax(-1, keepdim=True))[:, 0]
    with torch.no_grad():
        hit = torch.zeros_like(labels, dtype=torch.bool)
        hit[keep] = (logits.argmax(-1) if pick is None else pick) == target
        accept = 1 + hit.int().cumprod(-1).sum(-1)[keep[..., 0]].double()  # per block, bonus included
    return LossOutput(loss, int(keep.sum()), len(accept), float(accept.sum()), float((1 / accept).sum()),
                      unary.item(), pair_loss)


def init_drafter_weights(drafter: DFlashDrafter, std: float = 0.02, seed: int = 0) -> None:
    """HF-style init: normal(0, std) matrices, unit norms; scaled output projections keep the
    residual stream at its input scale however many layers there are.

    DFlash2 parts start as DFlash-1: identity conv kernels with zero deltas, and a small pairwise
    term (unit-scale predecessor codes, std-scale successor codes, so neither gradient is zero).
    """
    g = torch.Generator().manual_seed(seed)
    n = len(drafter.layers)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith("base_kernel"):
                p.zero_()
                p[:, 0] = 1.0
            elif name.endswith("kernel_projection.weight"):
                p.zero_()
            elif name.endswith("predecessor_codebook"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                scale = std / math.sqrt(2 * n) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * scale)
