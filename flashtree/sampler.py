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

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from flashtree.sampling import SamplingParams

CANDIDATES = (64, 1024)  # top-p seeks its nucleus among this many tokens before sorting the vocabulary
ADAPTIVE_ON_CPU = True  # tests turn it off to run the accelerator path (see _adaptive) on the CPU
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


def mix32_tail_(x: Tensor, scratch: Tensor) -> Tensor:
    """mix32 after its first step, in place: y ^ (y >> 16) -> mix32(y), on an int64 tensor the
    caller owns, with a scratch tensor of its shape (an allocating op would cost a pass over
    fresh memory). The first step distributes over xor, so for mix32(a ^ b) callers apply it to
    a and b apart, to small tensors. Adding (x & 1) << 31 and masking equals xoring x << 31 and
    masking (only bit 31 survives), and x << 31 < 2^63."""
    x.mul_(0x7FEB352D).bitwise_and_(M32)
    x ^= torch.bitwise_right_shift(x, 15, out=scratch)
    torch.bitwise_left_shift(x, 31, out=scratch)
    x.mul_(0x046CA68B).bitwise_xor_(scratch).bitwise_and_(M32)
    x ^= torch.bitwise_right_shift(x, 16, out=scratch)
    return x


def _first_step(x: Tensor) -> Tensor:
    """mix32's first step, which mix32_tail_ leaves to its callers."""
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
    thash = _token_half(tokens)
    shape = torch.broadcast_shapes(pkeys.shape, thash.shape)
    P, K = shape[:-1].numel(), shape[-1]
    out = torch.empty(shape, dtype=dtype, device=pkeys.device)
    th = thash.view(1, K) if thash.numel() == K else thash.expand(shape).reshape(P, K)
    _gumbel(_first_step(pkeys.expand(*shape[:-1], 1).reshape(P, 1)), th, out.view(P, K), add=False)
    return out


def _token_half(tokens: Tensor) -> Tensor:
    """The token ids' half of the noise hash, mix32(token ^ 0x68E31DA4), after mix32's first step."""
    return _first_step(mix32(tokens ^ 0x68E31DA4))


def vocab_noise(pkeys: Tensor, V: int, dtype: torch.dtype) -> Tensor:
    """gumbel_noise(pkeys, arange(V), dtype) for pkeys [P, 1]: [P, V]."""
    out = torch.empty(len(pkeys), V, dtype=dtype, device=pkeys.device)
    return _gumbel(_first_step(pkeys), token_hashes(V, pkeys.device), out, add=False)


_TOKEN_HASHES: dict[tuple[int, torch.device], Tensor] = {}
NOISE_BLOCK = 1 << 16  # CPU: entries hashed per step, so the int64 passes stay in the L2 cache


def token_hashes(V: int, device: torch.device) -> Tensor:
    """_token_half of the token ids < V: it does not depend on the position, so it is computed
    once per (V, device). Not stored while a CUDA graph is being captured, which records the fill
    without running it."""
    hashes = _TOKEN_HASHES.get((V, device))
    if hashes is None:
        hashes = _token_half(torch.arange(V, device=device))
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _TOKEN_HASHES[(V, device)] = hashes
    return hashes


def _gumbel(pk: Tensor, th: Tensor, out: Tensor, add: bool) -> Tensor:
    """out [P, K] = (or, with add, +=) the noise of h = mix32_tail_(pk ^ th) for the two halves
    after mix32's first step, pk [P, 1], th [K] or [P, K]. On the CPU a block of at most
    NOISE_BLOCK entries at a time, so that the hash's 11 int64 passes run in cache, and no
    noise table when adding.

    w is negated while scaled and clamped, and added as x - log(-log1p(-w)), which is exact, so
    the bits are those of g = -log(-log1p(-w)) with w = ((h.float() + 0.5) * 2^-32).clamp(max=
    1 - 2^-24) converted to out's dtype (adding a float32 g to float64 equals adding g.double())."""
    P, K = out.shape
    th = th.expand(P, K)
    cpu = out.device.type == "cpu"
    cols = max(1, min(K, NOISE_BLOCK if cpu else K))
    rows = max(1, min(P, NOISE_BLOCK // cols if cpu else P))
    h_buf = torch.empty(rows * cols, dtype=torch.long, device=out.device)
    s_buf = torch.empty_like(h_buf)
    direct = not add and out.dtype == torch.float32
    w_buf = None if direct else torch.empty_like(h_buf, dtype=torch.float32)
    for r0 in range(0, P, rows):
        r = min(rows, P - r0)
        for c0 in range(0, K, cols):
            c = min(cols, K - c0)
            h = torch.bitwise_xor(pk[r0 : r0 + r], th[r0 : r0 + r, c0 : c0 + c], out=h_buf[: r * c].view(r, c))
            mix32_tail_(h, s_buf[: r * c].view(r, c))
            o = out[r0 : r0 + r, c0 : c0 + c]
            w = o if direct else w_buf[: r * c].view(r, c)
            w.copy_(h).add_(0.5).mul_(-(2.0**-32)).clamp_(min=-(1.0 - 2.0**-24))
            w.log1p_().neg_().log_()  # -g
            if add:
                o -= w
                continue
            w.neg_()
            if not direct:
                o.copy_(w)
    return out


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


class SamplingStage:
    """Room for a round's sampling parameters: one fixed host buffer (pinned on CUDA) sent with one
    non-blocking copy into a fixed device buffer, so a round makes no `torch.tensor` copy.

    Reusing the host buffer is safe for a caller that reads each batch's results back (which
    waits for the copy) before it builds the next batch, as the runner does.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.host = torch.zeros(5, size, dtype=torch.long, pin_memory=device.type == "cuda")
        self.rows = self.host.numpy()
        self.device = self.host if device.type == "cpu" else torch.empty(5, size, dtype=torch.long, device=device)

    def upload(self, columns: np.ndarray) -> Tensor:
        n = columns.shape[1]
        self.rows[:, :n] = columns
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)
        return self.device[:, :n]


@dataclass
class SamplingBatch:
    size: int
    greedy_rows: int
    plain: SampledRows | None
    restricted: SampledRows | None

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], device: torch.device,
              stage: SamplingStage | None = None) -> SamplingBatch:
        """The round's parameters on the device: one host-to-device copy (through `stage` when given),
        none when every row is greedy."""
        plain = [i for i, p in enumerate(params) if not p.greedy and p.top_k <= 0 and p.top_p >= 1.0]
        restricted = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
        order = plain + restricted
        greedy_rows = len(params) - len(order)
        if not order:
            return cls(len(params), greedy_rows, None, None)
        top_ks = [min(max(params[i].top_k, 0), 2**31) for i in order]
        columns = np.empty((5, len(order)), dtype=np.int64)
        columns[0] = np.array([inverse_temperature(params[i].temperature) for i in order]).view(np.int64)
        columns[1] = np.array([params[i].top_p for i in order], dtype=np.float64).view(np.int64)
        columns[2], columns[3], columns[4] = top_ks, [seed_key(seeds[i]) for i in order], order
        packed = stage.upload(columns) if stage is not None else torch.from_numpy(columns).to(device)

        def rows(a: int, b: int) -> SampledRows | None:
            if a == b:
                return None
            return SampledRows(index=None if b - a == len(params) else packed[4, a:b],
                               scale=packed[0, a:b].view(torch.float64), top_p=packed[1, a:b].view(torch.float64),
                               top_k=packed[2, a:b], key=packed[3, a:b], top_ks=tuple(top_ks[a:b]),
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
    Host reads: none off the CPU. On the CPU, top-k/top-p rows at V > 64 may read a few small
    masks (was every node settled by its candidates?), where a read is free and a full sort of
    the vocabulary is not (see _adaptive).
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
    S, N, V = logits.shape
    x = _scaled(logits, rows).view(S * N, V)
    _add_vocab_noise(x, rows.key, positions, span)
    return _argmax(x).view(S, N)


def _argmax(x: Tensor) -> Tensor:
    """x.argmax(-1): max's indices are the same first index of the maximum (NaN first, as
    argmax), and on the CPU it is ~1.6x faster over a vocabulary."""
    return x.max(-1).indices


def _add_vocab_noise(x: Tensor, keys: Tensor, positions: Tensor, span: int | None, nodes: Tensor | None = None
                     ) -> None:
    """x [U, V] (float32 or float64) += the noise over the whole vocabulary of the nodes (all
    S * N, or `nodes`), hashed per node or, when that is fewer rows, once per distinct position
    (nodes at one depth share a position, hence their noise) into a table added row by row."""
    S, N = positions.shape
    U, V = x.shape
    if span is None or U <= S * span:
        pkeys = _first_step(position_keys(keys, positions).view(-1, 1))
        _gumbel(pkeys if nodes is None else pkeys[nodes], token_hashes(V, x.device), x, add=True)
        return
    base = positions.amin(1, keepdim=True)
    steps = torch.arange(span, device=positions.device)
    table = vocab_noise(position_keys(keys, base + steps).view(-1, 1), V, x.dtype)
    row = (span * torch.arange(S, device=positions.device)[:, None] + positions - base).view(-1)
    row = row if nodes is None else row[nodes]
    block = max(1, NOISE_BLOCK // V) if x.device.type == "cpu" else U  # the gathered rows stay small
    for i in range(0, U, block):
        x[i : i + block].add_(table[row[i : i + block]])


def _draw_restricted(logits: Tensor, rows: SampledRows, positions: Tensor, span: int | None) -> Tensor:
    """Gumbel-max over the kept tokens only: the noise is a function of the token id, so hashing
    just the candidates gives the same pick as hashing the whole vocabulary."""
    S, N, V = logits.shape
    x, probs, first = _restricted(logits, rows)
    pkeys = position_keys(rows.key, positions).view(-1)
    out = torch.empty(S * N, dtype=torch.long, device=logits.device)
    for nodes, ids, keep in _decide(probs, _node_top_p(rows, N), _levels(rows, V, x.device), first):
        xs, pk = (x, pkeys) if nodes is None else (x[nodes], pkeys[nodes])
        if ids is None:  # decided by the full sort: the whole vocabulary competes
            score = torch.where(keep, xs, NEG_INF)
            _add_vocab_noise(score, rows.key, positions, span, nodes)
            tokens = _argmax(score)
        else:
            score = torch.where(keep, xs.gather(-1, ids), NEG_INF)
            _gumbel(_first_step(pk[:, None]), token_hashes(V, x.device)[ids], score, add=True)
            tokens = ids.gather(-1, score.argmax(-1, keepdim=True))[:, 0]
        if nodes is None:
            out = tokens
        else:
            out[nodes] = tokens
    return out.view(S, N)


def processed_logprobs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Log-probs [R, N, V] of the distribution each node samples from (after temperature, top-k,
    top-p); greedy rows get the plain log_softmax of the raw logits. Dropped tokens are -inf;
    tokens whose probability underflows to 0 may come out as -inf or as their tiny log-prob."""
    out = torch.log_softmax(logits.to(compute_dtype(logits)), -1)
    for rows in (batch.plain, batch.restricted):
        if rows is None:
            continue
        sub = logits if rows.index is None else logits[rows.index]
        S, N, V = sub.shape
        if rows is batch.plain:
            x = _scaled(sub, rows).view(S * N, V)
        else:
            x, probs, first = _restricted(sub, rows)
            if rows.use_top_p:
                levels = _levels(rows, V, x.device)
                x = x.masked_fill(~_kept(probs, _decide(probs, _node_top_p(rows, N), levels, first)), NEG_INF)
        lp = torch.log_softmax(x, -1).view(S, N, V)
        if rows.index is None:
            out = lp
        else:
            out[rows.index] = lp
    return out


def _kept(probs: Tensor, decisions) -> Tensor:
    """The full-vocabulary keep mask [U, V] from `_decide`'s per-level answers."""
    kept = torch.empty_like(probs, dtype=torch.bool)
    for nodes, ids, keep in decisions:
        ps = probs if nodes is None else probs[nodes]
        if ids is not None:  # kept = ranked at or above the last kept candidate
            last = ids.gather(-1, keep.sum(-1, keepdim=True) - 1)
            p_last = ps.gather(-1, last)
            tokens = torch.arange(ps.shape[-1], device=ps.device)
            keep = (ps > p_last) | ((ps == p_last) & (tokens <= last))
        if nodes is None:
            kept = keep
        else:
            kept[nodes] = keep
    return kept


# ---- the distribution, batched ----------------------------------------------------------------

def _scaled(logits: Tensor, rows: SampledRows) -> Tensor:
    """(logits - max) * 1/temperature in the compute dtype: every entry <= 0 and never NaN."""
    dtype = compute_dtype(logits)
    x = logits.to(dtype)
    x = x - x.amax(-1, keepdim=True)
    scale = rows.scale.clamp(max=torch.finfo(dtype).max).to(dtype)
    return x.mul_(scale.view(-1, *[1] * (x.dim() - 1)))


def _max_top_k(rows: SampledRows, V: int) -> int:
    return max((k for k in rows.top_ks if 0 < k < V), default=0)


def _adaptive(device: torch.device) -> bool:
    """Whether top-k/top-p may settle nodes from a few candidates and fall back to sorting only
    the nodes those leave undecided. Picking those nodes is a host read: free on the CPU, where
    a full sort of 151,936 logits per node is not; on an accelerator the reverse holds, and the
    round must make no read before its end, so there a top-p row sorts its vocabulary outright."""
    return device.type == "cpu" and ADAPTIVE_ON_CPU


def _levels(rows: SampledRows, V: int, device: torch.device) -> list[int]:
    """Candidate counts to try, smallest first. kmax + 1, so that a last candidate of probability
    0 proves nothing was left out; top-p widens through CANDIDATES before it sorts everything.
    Without adaptive levels, top-p ranks the whole vocabulary at once."""
    if rows.use_top_p and not _adaptive(device):
        return [V]
    sizes = CANDIDATES if rows.use_top_p else (1,)
    return sorted({min(max(_max_top_k(rows, V) + 1, c), V) for c in sizes})


def _node_top_p(rows: SampledRows, N: int) -> Tensor | None:
    return rows.top_p[:, None].expand(-1, N).reshape(-1, 1) if rows.use_top_p else None


def _restricted(logits: Tensor, rows: SampledRows) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """Scaled, top-k-masked logits and their probabilities with nodes flattened, [S*N, V] each,
    and the first level's candidates [S*N, K], ranked. One topk gives both those and the k-th
    value: softmax is monotone, so ranking by logit ranks the probabilities alike."""
    S, N, V = logits.shape
    x = _scaled(logits, rows).view(S * N, V)
    top, ids = x.topk(_levels(rows, V, x.device)[0], -1)
    kmax = _max_top_k(rows, V)
    if kmax:
        k = rows.top_k.clamp(1, kmax)[:, None].expand(-1, N).reshape(-1, 1)
        active = ((rows.top_k > 0) & (rows.top_k < V))[:, None].expand(-1, N).reshape(-1, 1)
        x = x.masked_fill_(active & (x < top.gather(-1, k - 1)), NEG_INF)
    probs = torch.softmax(x, -1)
    return x, probs, _ranked(probs.gather(-1, ids), ids)


def _ranked(vals: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Candidates in the full stable sort's order, (probability desc, id asc): topk returns
    tied values in no particular order."""
    ids, order = ids.sort(-1)
    vals, order = vals.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, order)


def _decide(probs: Tensor, top_p: Tensor | None, sizes: list[int], first: tuple[Tensor, Tensor]):
    """Each node's kept set, from as few candidates as decide it exactly.

    Yields (nodes, ids, keep): the nodes (None = all) tried at a level, their candidate ids
    [U, K] ranked, and the keep mask over those; last, for nodes no level decided, ids None
    and the full sort's keep mask [U, V]. A node a level leaves undecided comes again later,
    and the consumer must overwrite what it wrote for it. Host reads: a few per level after
    the first, none when the first level is the whole vocabulary.
    """
    if top_p is None and not _adaptive(probs.device):
        # top-k alone: the logits are already masked to it, so the whole vocabulary competes
        # (ties at the k-th value included) and no candidate set needs checking.
        yield None, None, torch.ones_like(probs, dtype=torch.bool)
        return
    nodes, to_sort = None, []
    for level, K in enumerate(sizes):
        vals, ids = first if level == 0 else _ranked(*probs[nodes].topk(K, -1))
        tp = None if top_p is None else top_p if nodes is None else top_p[nodes]
        keep = torch.ones_like(vals, dtype=torch.bool) if tp is None else _nucleus(vals, tp)
        yield nodes, ids, keep
        if K == probs.shape[-1]:
            return  # the whole vocabulary, ranked as the full sort ranks it
        undecided = ~_decided(vals, keep)
        here = torch.arange(len(vals), device=vals.device) if nodes is None else nodes
        if tp is not None and level + 1 < len(sizes):
            # Each token past the K-th holds at most the K-th's probability: a nucleus that the
            # next level cannot hold even then goes straight to the sort (margin for rounding).
            reach = vals.sum(-1, keepdim=True) + (sizes[level + 1] - K) * vals[:, -1:]
            hopeless = undecided & (reach * 1.001 < tp)[:, 0]
            to_sort.append(here[hopeless])
            undecided &= ~hopeless
        nodes = here[undecided]
        if nodes.numel() == 0:
            break
    nodes = torch.cat([*to_sort, nodes])
    if nodes.numel():
        p = probs[nodes]
        yield nodes, None, torch.ones_like(p, dtype=torch.bool) if top_p is None else _full_keep(p, top_p[nodes])


def _nucleus(ranked: Tensor, top_p: Tensor) -> Tensor:
    """Keep mask over a ranked prefix: drop a token when the mass ranked above it is >= top_p.

    Everything from the first dropped token on is dropped, so the kept set is a prefix even
    where a parallel cumsum is not monotone; the top token is always kept (top_p may underflow
    to 0 in float32). top_p >= 1 keeps everything.
    """
    K = ranked.shape[-1]
    before = F.pad(ranked.cumsum(-1)[..., :-1], (1, 0))
    drop = before >= top_p.to(ranked.dtype)
    drop[..., 0] = False
    first = drop.to(torch.uint8).argmax(-1, keepdim=True)  # the first drop, or 0 when none
    first = torch.where(drop.gather(-1, first), first, K)
    return (torch.arange(K, device=ranked.device) < first) | (top_p >= 1.0)


def _decided(ranked: Tensor, keep: Tensor) -> Tensor:
    """Whether K < V ranked candidates fix a node's kept set exactly as the full sort would.

    Yes when the cut falls inside them strictly above the last candidate's probability (every
    token above that value is a candidate, ranked alike, so the cumsum up to the cut is the
    full sort's), or when the last candidate has probability 0 (every token that can be drawn
    is a candidate).
    """
    m = keep.sum(-1, keepdim=True)
    last = ranked[..., -1:]
    inside = (m < ranked.shape[-1]) & (ranked.gather(-1, m - 1) > last)
    return (inside | (last == 0))[..., 0]


def _full_keep(probs: Tensor, top_p: Tensor) -> Tensor:
    """The definition: a stable full sort (ties: lower id first), then the nucleus rule."""
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, _nucleus(ranked, top_p))


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
