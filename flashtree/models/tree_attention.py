"""Tree verification as two attentions merged by log-sum-exp: the committed prefix, then the tree.

A tree window of n nodes attends each slot's committed prefix (every key visible) plus its own n
keys under the ancestor mask. Computing the two parts apart keeps the long part free of any mask
(flash-eligible on CUDA) and confines the mask to an [n, n] block; their softmaxes combine
exactly: out = w * out_prefix + (1 - w) * out_tree with w = sigmoid(lse_prefix - lse_tree).

The prefix part is mask-free when every row starts at the same length (batch 1, and most
batches). Rows at different lengths attend the longest prefix through a per-row key padding mask
[R, 1, 1, P]; a captured round, whose starts are tensors only, does the same over its key bucket.
A row with no prefix (start 0) keeps one padding key visible, so no kernel sees an empty row, and
its prefix LSE gets -inf, so its weight is exactly 0.

Grouped-query heads fold into the query axis (q [R, H, n, D] -> [R, Hkv, G*n, D]): each KV head
is read once, with no repeat of the prefix K/V.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashtree.models.mask import additive

_OPS = torch.ops.aten


CPU_MIN_PREFIX = 2048  # committed keys from which the CPU takes this path (benchmarks/tree_attention.py)
_checked: dict[tuple[str, torch.dtype], bool] = {}  # (device type, dtype) -> the kernels passed check_kernels


def lse_path(device: torch.device, prefix_len: int, dtype: torch.dtype) -> bool:
    """Whether a tree verify whose prefix part spans prefix_len keys takes this path. CUDA: wherever
    check_kernels passed at startup, since the prefix becomes flash-eligible (benchmarks/gpu_check.py
    times it). CPU: from CPU_MIN_PREFIX keys, where skipping the [n, key_len] mask outweighs the extra
    kernels; one masked SDPA is faster below (docs/performance.md)."""
    if device.type == "cpu":
        return prefix_len >= CPU_MIN_PREFIX
    return _checked.get((device.type, dtype), False)


def check_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Run this path once against one masked SDPA on a small GQA tree (unequal starts, a start 0)
    and keep the answer for lse_path. The private kernels it calls differ between PyTorch builds,
    so a build where one fails or disagrees keeps the one-bias path, with one line saying so.
    Call it outside graph capture (it reads the result back)."""
    key = (device.type, dtype)
    if key not in _checked:
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            r, h, hkv, n, p, d = 2, 4, 2, 5, 40, 64
            q, k, v = (torch.randn(r, x, n, d, generator=g).to(device, dtype) for x in (h, hkv, hkv))
            keys, values = (torch.randn(r, hkv, p, d, generator=g).to(device, dtype) for _ in range(2))
            starts = torch.tensor([0, p], device=device)
            anc = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)).expand(r, n, n)
            parts = tree_parts(starts, [0, p], anc, p + n, dtype)
            got = tree_attention(q, k, v, keys, values, parts, d**-0.5)
            visible = torch.cat([torch.arange(p, device=device)[None, :] < starts[:, None], torch.ones(r, n, dtype=torch.bool, device=device)], 1)
            mask = visible[:, None, None, :] & torch.cat([visible[:, None, :p].expand(r, n, p), anc], 2)[:, None]
            want = torch.nn.functional.scaled_dot_product_attention(
                q, torch.cat([keys, k], 2), torch.cat([values, v], 2), attn_mask=mask, scale=d**-0.5, enable_gqa=True)
            _checked[key] = bool(torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2))
        except RuntimeError as e:  # a kernel this build lacks or refuses
            _checked[key] = False
            print(f"flashtree: tree attention keeps one masked SDPA on {device.type} {dtype} ({e.__class__.__name__}: "
                  f"{str(e).splitlines()[0][:120]})", file=sys.stderr)
        else:
            if not _checked[key]:
                print(f"flashtree: tree attention keeps one masked SDPA on {device.type} {dtype} (the LSE path "
                      f"disagreed with it)", file=sys.stderr)
    return _checked[key]


@dataclass
class TreeParts:
    """What every layer's tree attention shares in one forward, built once by `tree_parts`."""

    prefix_len: int  # P: the prefix part reads rows 0..P-1 of each slot (0: no row has a prefix)
    prefix_bias: Tensor | None  # [R, 1, 1, P] additive key padding (key < start); None: every row starts at P
    prefix_lse_bias: Tensor | None  # [R, 1, 1]: -inf for rows with no prefix, else 0; None: none such
    tree_bias: Tensor  # [R, 1, n, n] additive ancestor-or-self mask over the window's own keys
    _folded: dict[int, Tensor] = field(default_factory=dict)  # group size -> tree_bias over G*n query rows

    def folded_tree_bias(self, group: int) -> Tensor:
        """tree_bias with the query axis repeated per head of a KV group ([R, 1, G*n, n]), built by
        the first layer that asks and reused by the rest."""
        bias = self._folded.get(group)
        if bias is None:
            bias = self._folded[group] = _aligned(self.tree_bias.repeat(1, 1, group, 1))
        return bias


def tree_parts(starts: Tensor, start_list: list[int], ancestors: Tensor, key_len: int, dtype: torch.dtype
               ) -> TreeParts:
    """The prefix and tree masks of a window with ancestor mask [R, n, n].

    start_list: the starts on the host, or [] when only the tensor may be read (a captured round);
    then the prefix spans key_len - n rows, the most any row's start can be.
    """
    n = ancestors.shape[1]
    tree_bias = additive(ancestors[:, None], dtype)
    if start_list and len(set(start_list)) == 1:  # one shared start: mask-free (or no prefix at all)
        return TreeParts(start_list[0], None, None, tree_bias)
    p = max(start_list) if start_list else key_len - n
    if p == 0:
        return TreeParts(0, None, None, tree_bias)
    keys = torch.arange(p, device=starts.device)
    visible = keys[None, :] < starts.clamp(min=1)[:, None]  # start 0 keeps key 0: no empty softmax row
    no_prefix = torch.where(starts > 0, 0.0, float("-inf")).to(torch.float32)
    return TreeParts(p, _aligned(additive(visible[:, None, None], dtype)), no_prefix[:, None, None], tree_bias)


def tree_attention(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, parts: TreeParts, scale: float
                   ) -> Tensor:
    """Attention of the window's queries q [R, H, n, D] over the prefix keys/values [R, Hkv, P, D]
    (no ancestor mask) and the window's own k/v [R, Hkv, n, D] (ancestor mask), merged by LSE.
    Equals SDPA over [prefix ++ window] with the tree's full additive mask; returns [R, H, n, D]."""
    r, h, n, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    qf = q.reshape(r, hkv, group * n, d)  # kv-major heads, as enable_gqa pairs them
    out_t, lse_t = _attend(qf, k, v, parts.folded_tree_bias(group), scale)
    # reshape, not view: CUDA's kernels return [R, M, Hkv, D] memory under the [R, Hkv, M, D] shape.
    if parts.prefix_len == 0:
        return out_t.to(q.dtype).reshape(r, h, n, d)
    out_p, lse_p = _attend(qf, keys, values, parts.prefix_bias, scale)
    diff = lse_p - lse_t if parts.prefix_lse_bias is None else lse_p - lse_t + parts.prefix_lse_bias
    w = torch.sigmoid(diff)[..., None]  # the prefix's share of the softmax mass, in float32 or wider
    out = torch.addcmul(out_t, w, out_p - out_t)  # out_t + w * (out_p - out_t)
    return out.to(q.dtype).reshape(r, h, n, d)


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """(out [R, Hkv, M, D], lse [R, Hkv, M]) of q over k/v with an optional additive bias that
    broadcasts to [R, Hkv, M, S], from a fused kernel where the device has one that returns the LSE."""
    if q.device.type == "cpu":
        return _OPS._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        m = q.shape[2]
        if bias is None and q.dtype != torch.float32 and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
            out, lse = _OPS._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
            return out, lse
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], m, k.shape[2])
        out, lse = _OPS._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)[:2]
        return out, lse[..., :m]  # the kernel pads its LSE rows to a multiple of 32
    return _math(q, k, v, bias, scale)


def _aligned(bias: Tensor) -> Tensor:
    """On CUDA, the bias with its rows padded to a multiple of 16 keys and sliced back, as SDPA does
    for the memory-efficient kernel, whose bias strides must be aligned; elsewhere the bias as is."""
    s = bias.shape[-1]
    if bias.device.type != "cuda" or s % 16 == 0:
        return bias
    return torch.nn.functional.pad(bias, (0, -s % 16))[..., :s]


def _math(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """The reference: softmax by hand, in at least float32, for devices or dtypes without a kernel."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.to(acc))
    return out, lse
