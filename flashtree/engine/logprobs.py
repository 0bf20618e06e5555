"""Log-probabilities of committed tokens, from the target's own distribution at each position.

(Prompt tokens, which nothing sampled, are scored by the plain log-softmax: see
ModelRunner.score_prompt.)

The distribution is the one the token was sampled from: the logits after temperature, top-k and
top-p (vLLM's "processed_logprobs" mode; flashtree.sampler.processed_logprobs computes it);
greedy requests get the plain log-softmax. Every
method commits a token from that same distribution (the verify forward computes the target's
logits at every tree node; the accepted path's nodes are the committed positions), so ar,
dflash and ddtree return the same logprobs for the same tokens. Tokens a filter dropped have
logprob -inf and are never listed as alternatives.

On the device the values ride in float64 next to token ids (float64 holds every id exactly), so
they come back in the read the round makes anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtree.engine.sequence import TokenLogprob

NEG_INF = float("-inf")


def pack(logprobs: Tensor, tokens: Tensor, k: int) -> Tensor:
    """[R, A, 1 + 2k] float64: each token's logprob, then the k best logprobs and their ids.
    logprobs [R, A, V]; tokens [R, A] (negative = padding, read as token 0)."""
    chosen = logprobs.gather(-1, tokens.clamp(min=0)[..., None])
    if k == 0:
        return chosen.double()
    top = logprobs.topk(k, dim=-1)
    return torch.cat([chosen.double(), top.values.double(), top.indices.double()], dim=-1)


def unpack(values: list[float], tokens: list[int], k: int, width: int) -> list[TokenLogprob]:
    """The TokenLogprobs of `tokens` from a host row of pack()'s output flattened (`width` = its
    packed k), keeping this request's own k alternatives; tokens the filters dropped (-inf) are
    no alternatives, so `top` is shorter than k when fewer than k tokens can be sampled."""
    stride = 1 + 2 * width
    out = []
    for j, token in enumerate(tokens):
        row = values[j * stride:(j + 1) * stride]
        top = [(int(i), v) for v, i in zip(row[1:1 + k], row[1 + width:1 + width + k]) if v != NEG_INF]
        out.append(TokenLogprob(token, row[0], top))
    return out
