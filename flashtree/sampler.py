"""The target's token at every tree node, for the whole batch at once.

The accept walk is lossless for any rule that draws each node's token from the target's
distribution at that node, with fresh randomness at every committed position. Gumbel-max with
noise hashed from (seed, absolute position, token id) is such a rule, and it makes the token at
a position a function of (seed, position, distribution) alone: ar, dflash, ddtree at any budget,
in any batch, commit the same tokens for one seed (docs/sampling.md).

The distribution, defined by `probabilities`: logits shifted so their max is 0 and scaled by
1/temperature, then top-k (every token tied with the k-th stays), then top-p over tokens ranked
by (probability desc, id asc), a token dropped when the mass ranked strictly above it is
>= top_p, the top token always kept.

Numerical safety: 1/temperature is clamped to the compute dtype's largest finite value, and the
shifted logits are <= 0, so no temperature > 0 makes inf * 0 or inf - inf: a temperature below
about 3e-39 (float32) acts as 3e-39, which for any logit gap above ~1e-30 is the greedy limit
(ties split uniformly). top_p underflowing to 0 still keeps the top token. So no accepted
temperature or top_p can produce NaN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from flashtree.sampling import SamplingParams

CANDIDATES = 1024  # top-p looks for its nucleus among this many tokens before sorting the vocabulary
M32 = 0xFFFFFFFF
NEG_INF = float("-inf")


# ---- counter-based noise ----------------------------------------------------------------------

def mix32(x):
    """A 32-bit finalizer (lowbias32, C. Wellons) on Python ints or int64 tensors in [0, 2^32).

    Every product stays below 2^63, so int64 never overflows and the bits are the same on every
    device: the second multiplier 0x846CA68B is split as 2^31 + 0x046CA68B.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x046CA68B + ((x & 1) << 31)) & M32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A request's seed (any int, taken mod 2^64) as a 32-bit key."""
    return mix32(mix32(seed & M32) ^ ((seed >> 32) & M32))


def fresh_seed() -> int:
    """A random 63-bit seed for a request that gave none: fresh randomness, same code path."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def position_keys(keys: Tensor, positions: Tensor) -> Tensor:
    """Per-(request, absolute position) keys: keys [S], positions [S, ...] -> int64 [S, ...]."""
    k = keys.view(-1, *[1] * (positions.dim() - 1))
    return mix32(k ^ mix32((positions & M32) ^ 0x9E3779B9))


def gumbel_noise(pkeys: Tensor, tokens: Tensor, dtype: torch.dtype) -> Tensor:
    """Gumbel(0, 1) noise for (position key, token id), broadcast: pkeys [..., 1], tokens [..., K].

    g = -log(-log1p(-w)) with w = (h + 0.5) / 2^32 from a 32-bit hash h: the log1p keeps small
    exponentials (the winning tail) fine-grained, so g reaches ~22.9; a token more than ~25.7
    below the top in scaled logit (relative probability < 7e-12) can never win, a total
    variation of at most 7e-12 * V (1e-6 at V = 151,936).
    """
    h = mix32(pkeys ^ mix32(tokens ^ 0x68E31DA4))
    w = ((h.to(torch.float32) + 0.5) * 2.0**-32).clamp_(max=1.0 - 2.0**-24)
    return w.neg_().log1p_().neg_().log_().neg_().to(dtype)


# ---- the per-round batch of parameters --------------------------------------------------------

@dataclass
class SampledRows:
    """Rows of one kind: `plain` (temperature only) or `restricted` (top-k and/or top-p)."""

    index: Tensor | None  # [S] rows of the batch; None when this kind is every row
    scale: Tensor  # [S] float64: 1/temperature (clamped to the compute dtype when used)
    top_k: Tensor  # [S] int64, 0 = off
    top_p: Tensor  # [S] float64, 1 = off
    key: Tensor  # [S] int64: seed_key(seed)
    top_ks: tuple[int, ...]  # the same top_k on the host, to size topk without a sync
    use_top_p: bool


@dataclass
class SamplingBatch:
    size: int
    greedy_rows: int
    plain: SampledRows | None
    restricted: SampledRows | None

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], device: torch.device) -> SamplingBatch:
        """The round's parameters as device tensors: one host-to-device copy, none when all greedy."""
        plain = [i for i, p in enumerate(params) if not p.greedy and p.top_k <= 0 and p.top_p >= 1.0]
        restricted = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
        order = plain + restricted
        greedy_rows = len(params) - len(order)
        if not order:
            return cls(len(params), greedy_rows, None, None)
        floats = torch.tensor([[inverse_temperature(params[i].temperature) for i in order],
                               [params[i].top_p for i in order]], dtype=torch.float64)
        ints = torch.tensor([[max(params[i].top_k, 0) for i in order], [seed_key(seeds[i]) for i in order],
                             order], dtype=torch.int64)
        packed = torch.cat([floats.view(torch.int64), ints]).to(device, non_blocking=True)

        def rows(a: int, b: int) -> SampledRows | None:
            if a == b:
                return None
            top_ks = tuple(max(params[i].top_k, 0) for i in order[a:b])
            return SampledRows(index=None if b - a == len(params) else packed[4, a:b],
                               scale=packed[0, a:b].view(torch.float64), top_p=packed[1, a:b].view(torch.float64),
                               top_k=packed[2, a:b], key=packed[3, a:b], top_ks=top_ks,
                               use_top_p=any(params[i].top_p < 1.0 for i in order[a:b]))

        return cls(len(params), greedy_rows, rows(0, len(plain)), rows(len(plain), len(order)))


def inverse_temperature(temperature: float) -> float:
    return 1.0 / temperature  # inf for subnormal temperatures; clamped where it is applied


def compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


# ---- picking ----------------------------------------------------------------------------------

def pick(logits: Tensor, batch: SamplingBatch, positions: Tensor, span: int | None = None) -> Tensor:
    """Every node's token: logits [R, N, V] -> int64 [R, N].

    positions [R, N]: the absolute position (in prompt + output) of the token each node's logits
    predict, i.e. the node's own position + 1. span: a bound on the distinct positions per row
    (max - min < span; the tree's depth bound + 1), so plain rows hash noise once per position
    instead of once per node; None = N. Greedy rows take the argmax (ties: lowest id).
    Host reads: none, except one when a top-p nucleus may reach past CANDIDATES tokens.
    """
    R, N, _ = logits.shape
    picks = logits.argmax(-1) if batch.greedy_rows else torch.empty(R, N, dtype=torch.long, device=logits.device)
    for rows, draw in ((batch.plain, _draw_plain), (batch.restricted, _draw_restricted)):
        if rows is None:
            continue
        if rows.index is None:
            picks = draw(logits, rows, positions, span)
        else:
            picks[rows.index] = draw(logits[rows.index], rows, positions[rows.index], span)
    return picks


def _draw_plain(logits: Tensor, rows: SampledRows, positions: Tensor, span: int | None) -> Tensor:
    x = _scaled(logits, rows)
    S, N, V = x.shape
    tokens = torch.arange(V, device=x.device)
    if span is None or span >= N:
        x += gumbel_noise(position_keys(rows.key, positions)[..., None], tokens, x.dtype)
        return x.argmax(-1)
    # Nodes at one depth share a position, hence their noise: hash each position once.
    base = positions.amin(1, keepdim=True)
    table = gumbel_noise(position_keys(rows.key, base + torch.arange(span, device=x.device))[..., None], tokens, x.dtype)
    x += table.gather(1, (positions - base)[..., None].expand(S, N, V))
    return x.argmax(-1)


def _draw_restricted(logits: Tensor, rows: SampledRows, positions: Tensor, span: int | None) -> Tensor:
    """Gumbel-max over the kept tokens only: the noise is a function of the token id, so hashing
    just the candidates gives the same pick as hashing the whole vocabulary."""
    x = _top_k(_scaled(logits, rows), rows)
    V = x.shape[-1]
    probs = torch.softmax(x, -1)
    K = _num_candidates(rows, V)
    vals, ids = _ranked_candidates(probs, K)
    keep = _nucleus(vals, rows.top_p[:, None, None]) if rows.use_top_p else torch.ones_like(vals, dtype=torch.bool)
    pkeys = position_keys(rows.key, positions)
    score = torch.where(keep, x.gather(-1, ids), NEG_INF) + gumbel_noise(pkeys[..., None], ids, x.dtype)
    out = ids.gather(-1, score.argmax(-1, keepdim=True))[..., 0]
    if K < V:
        missed = ~_resolved(vals, keep)
        if bool(missed.any()):  # the one host read: only top-p with a wide nucleus, or k-th ties
            s, n = missed.nonzero(as_tuple=True)
            full = _full_keep(probs[s, n], rows.top_p[s, None]) if rows.use_top_p else torch.ones_like(probs[s, n], dtype=torch.bool)
            score = torch.where(full, x[s, n], NEG_INF) + gumbel_noise(pkeys[s, n, None], torch.arange(V, device=x.device), x.dtype)
            out[s, n] = score.argmax(-1)
    return out


def processed_logprobs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Log-probs [R, N, V] of the distribution each node samples from (after temperature, top-k,
    top-p); greedy rows get the plain log_softmax of the raw logits. Dropped tokens are -inf;
    tokens whose probability underflows to 0 may come out as -inf or as their tiny log-prob."""
    out = torch.log_softmax(logits.to(compute_dtype(logits)), -1)
    for rows in (batch.plain, batch.restricted):
        if rows is None:
            continue
        sub = logits if rows.index is None else logits[rows.index]
        x = _scaled(sub, rows)
        if rows is batch.restricted:
            x = _top_k(x, rows)
            if rows.use_top_p:
                x = x.masked_fill_(~_top_p_keep(x, rows), NEG_INF)
        lp = torch.log_softmax(x, -1)
        if rows.index is None:
            out = lp
        else:
            out[rows.index] = lp
    return out


# ---- the distribution, batched ----------------------------------------------------------------

def _scaled(logits: Tensor, rows: SampledRows) -> Tensor:
    """(logits - max) * 1/temperature in the compute dtype: every entry <= 0 and never NaN."""
    dtype = compute_dtype(logits)
    x = logits.to(dtype)
    x = x - x.amax(-1, keepdim=True)
    scale = rows.scale.clamp(max=torch.finfo(dtype).max).to(dtype)
    return x.mul_(scale.view(-1, *[1] * (x.dim() - 1)))


def _top_k(x: Tensor, rows: SampledRows) -> Tensor:
    """Drop (in place) every token below each row's k-th largest; rows with k off or >= V keep all."""
    V = x.shape[-1]
    kmax = max((k for k in rows.top_ks if 0 < k < V), default=0)
    if kmax == 0:
        return x
    k = rows.top_k.clamp(1, kmax).view(-1, 1, 1).expand(*x.shape[:-1], 1)
    kth = x.topk(kmax, -1).values.gather(-1, k - 1)
    active = ((rows.top_k > 0) & (rows.top_k < V)).view(-1, 1, 1)
    return x.masked_fill_(active & (x < kth), NEG_INF)


def _num_candidates(rows: SampledRows, V: int) -> int:
    """kmax + 1, so that the last candidate having probability 0 proves nothing was left out."""
    kmax = max((k for k in rows.top_ks if 0 < k < V), default=0)
    K = max(kmax + 1, CANDIDATES if rows.use_top_p else 1)
    return min(K, V)


def _ranked_candidates(probs: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """The K most probable tokens ranked by (probability desc, id asc), the full sort's order."""
    vals, ids = probs.topk(K, -1)
    ids, order = ids.sort(-1)
    vals, order = vals.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, order)


def _nucleus(ranked: Tensor, top_p: Tensor) -> Tensor:
    """Keep mask over a ranked prefix: drop a token when the mass ranked above it is >= top_p.

    The exclusive cumsum is made monotone so the kept set is always a prefix; the top token is
    always kept (top_p may underflow to 0 in float32). top_p >= 1 keeps everything.
    """
    tp = top_p.to(ranked.dtype)
    before = F.pad(ranked.cumsum(-1)[..., :-1], (1, 0)).cummax(-1).values
    keep = before < tp
    keep[..., 0] = True
    return keep | (top_p >= 1.0)


def _resolved(ranked: Tensor, keep: Tensor) -> Tensor:
    """Whether the candidates decide a node's kept set exactly as the full sort would.

    Yes when the last candidate has probability 0 (every positive token is a candidate), or
    when the nucleus ends inside the candidates strictly above the last candidate's value: every
    token above that value is a candidate and the (prob, id) ranking orders them alike.
    """
    K = ranked.shape[-1]
    m = keep.sum(-1, keepdim=True)
    last = ranked[..., -1:]
    inside = (m < K) & (ranked.gather(-1, m - 1) > last)
    return ((last == 0) | inside)[..., 0]


def _full_keep(probs: Tensor, top_p: Tensor) -> Tensor:
    """The definition: a stable full sort (ties: lower id first), then the nucleus rule."""
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, _nucleus(ranked, top_p))


def _top_p_keep(x: Tensor, rows: SampledRows) -> Tensor:
    """Full-vocabulary top-p keep mask [S, N, V], from the candidates where they decide it."""
    probs = torch.softmax(x, -1)
    V = x.shape[-1]
    top_p = rows.top_p[:, None, None]
    K = _num_candidates(rows, V)
    if K >= V:
        return _full_keep(probs, top_p)
    vals, ids = _ranked_candidates(probs, K)
    keep = _nucleus(vals, top_p)
    last = keep.sum(-1, keepdim=True) - 1
    p_last, i_last = vals.gather(-1, last), ids.gather(-1, last)
    tokens = torch.arange(V, device=x.device)
    full = (probs > p_last) | ((probs == p_last) & (tokens <= i_last))
    missed = ~_resolved(vals, keep)
    if bool(missed.any()):
        s, n = missed.nonzero(as_tuple=True)
        full[s, n] = _full_keep(probs[s, n], rows.top_p[s, None])
    return full | (top_p >= 1.0)


# ---- the definition, one request at a time (tests and docs compare against it) ---------------

def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The target's sampling distribution [..., V] for one request's logits [..., V]."""
    dtype = compute_dtype(logits)
    x = logits.to(dtype)
    if params.greedy:
        return F.one_hot(x.argmax(-1), x.shape[-1]).to(dtype)
    x = (x - x.amax(-1, keepdim=True)) * min(inverse_temperature(params.temperature), torch.finfo(dtype).max)
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        top_p = torch.full((*probs.shape[:-1], 1), params.top_p, dtype=torch.float64)
        probs = probs * _full_keep(probs, top_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
