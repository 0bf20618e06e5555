"""The walk of one step's trees under their requests' sampling parameters, and what it hands back to vLLM:
an ordinary accepted chain per request, the K/V moves that make the cache that chain's, the drafter's
context order, and the logprobs of the accepted nodes' rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashtree.sampler import SamplingBatch, pick
from flashtree.tree import accept_walk
from flashtree.integrations.vllm.verify import VerifyPlan


@dataclass
class Walked:
    plan: VerifyPlan
    path: Tensor  # [Rt, D + 1] accepted node at each depth (root first), -1 past the last
    num_nodes: Tensor  # [Rt] accepted nodes, root included = tokens the request emits
    tokens: Tensor  # [Rt, D + 1] emitted tokens: the accepted drafted tokens, then the bonus; -1 padded


def walk(plan: VerifyPlan, logits: Tensor) -> Walked:
    """Pick the target's token at every node (argmax, or a Gumbel-max sample keyed by the request's seed
    and the position it predicts) and follow the picks down each tree: lossless for both."""
    if plan.greedy:
        picks = logits.argmax(-1)
    else:
        batch = SamplingBatch.build(plan.params, plan.seeds, logits.device)
        predicts = plan.prefix[:, None] + plan.spec.depths + 1
        picks = pick(logits, batch, predicts.to(logits.device), span=plan.spec.depth_bound + 1)
    result = accept_walk(plan.spec, picks)
    return Walked(plan, result.path, result.num_nodes, result.tokens)


def kv_moves(walked: Walked) -> tuple[Tensor, Tensor]:
    """(source token row, destination token row) for every accepted node whose K/V is not already at the
    slot of its path position: node path[k] of tree r moves to the slot vLLM gave row start[r] + k."""
    path, plan = walked.path, walked.plan
    k = torch.arange(path.shape[1])
    move = (k >= 1) & (k < walked.num_nodes[:, None]) & (path != k)
    r, depth = move.nonzero(as_tuple=True)
    return plan.start[r] + path[r, depth], plan.start[r] + depth


def on_spine(walked: Walked) -> bool:
    """Whether every accepted path is the first nodes in order, so nothing moves."""
    k = torch.arange(walked.path.shape[1])
    return bool(((walked.path == k) | (k >= walked.num_nodes[:, None])).all())


def compact_kv(walked: Walked, move) -> None:
    """Copy the accepted nodes' K/V to the slots of their path positions in every target layer.

    move(cache, src_slots, dst_slots) copies within one layer's cache. A node's slot is never
    overwritten before it is read: path[k] >= k, so every source lies at or after every earlier
    destination.
    """
    src, dst = kv_moves(walked)
    plan = walked.plan
    if src.numel() == 0 or plan.slot_mapping is None:
        return
    src_slots, dst_slots = plan.slot_mapping[src], plan.slot_mapping[dst]
    for cache in plan.caches:
        move(cache, src_slots, dst_slots)


def drafter_order(walked: Walked, num_tokens: int) -> Tensor:
    """A permutation of the batch's token rows that puts each tree's accepted path first, in path
    order, then its other nodes: the drafter then reads the accepted nodes' states at positions
    prefix..prefix+a, and the rejected ones after them, where they overwrite nothing it keeps."""
    plan = walked.plan
    Rt, N = plan.rows.shape
    node = torch.arange(N).expand(Rt, N)
    key = torch.where(plan.valid, N + node, 2 * N + node)
    on_path = walked.path >= 0
    r, depth = on_path.nonzero(as_tuple=True)
    key = key.clone()
    key[r, walked.path[r, depth]] = depth
    perm = key.argsort(dim=1)
    order = torch.arange(num_tokens)
    order[plan.rows[plan.valid]] = (plan.start[:, None] + perm)[plan.valid]
    return order


def output_rows(sampled: Tensor, walked: Walked) -> Tensor:
    """vLLM's [R, width] accepted-tokens tensor with the trees' rows replaced by their walks."""
    width = max(sampled.shape[1], walked.tokens.shape[1])
    out = sampled.new_full((sampled.shape[0], width), -1)
    out[:, :sampled.shape[1]] = sampled
    rows = walked.plan.req_index
    out[rows] = -1
    out[rows, :walked.tokens.shape[1]] = walked.tokens.to(out.dtype)
    return out


def node_rows(walked: Walked, logits_start: Tensor) -> Tensor:
    """[Rt, D + 1] the logits row behind each emitted token: token k is chosen at node path[k]."""
    return logits_start[:, None] + walked.path.clamp(min=0)


def merge_logprobs(lp, old_width: int, walked: Walked, logits: Tensor, logits_start: Tensor, raw_logits: bool,
                   gather):
    """vLLM's flattened [R * width] logprobs, widened to the output's width, with each tree row's
    entries taken from the rows of the nodes that chose its tokens. gather is vLLM's
    Sampler.gather_logprobs, so top-k and ranks follow vLLM's rules."""
    ids, values, ranks = lp.logprob_token_ids, lp.logprobs, lp.selected_token_ranks
    R = ids.shape[0] // old_width
    width = max(old_width, walked.tokens.shape[1])

    def widen(t: Tensor) -> Tensor:
        t = t.view(R, old_width, *t.shape[1:])
        out = t.new_zeros((R, width, *t.shape[2:]))
        out[:, :old_width] = t
        return out

    ids, values, ranks = widen(ids), widen(values), widen(ranks)
    rows = node_rows(walked, logits_start)
    Rt, cols = rows.shape
    x = logits[rows.flatten()].to(torch.float32)
    lps = x if raw_logits else x.log_softmax(-1)
    got = gather(lps, ids.shape[-1] - 1, walked.tokens.clamp(min=0).flatten().to(torch.int64))
    at = walked.plan.req_index
    ids[at, :cols] = got.logprob_token_ids.view(Rt, cols, -1).to(ids.dtype)
    values[at, :cols] = got.logprobs.view(Rt, cols, -1).to(values.dtype)
    ranks[at, :cols] = got.selected_token_ranks.view(Rt, cols).to(ranks.dtype)
    return type(lp)(ids.flatten(0, 1), values.flatten(0, 1), ranks.flatten(0, 1))
