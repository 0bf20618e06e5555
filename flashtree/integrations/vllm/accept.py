"""The walk of one step's trees under their requests' sampling parameters, and what it hands back to vLLM:
an ordinary accepted chain per request, the K/V moves that make the cache that chain's, the drafter's
context order, and the logprobs of the accepted nodes' rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flashtree.sampler import SamplingBatch, pick
from flashtree.integrations.vllm.verify import VerifyPlan


@dataclass
class Walked:
    plan: VerifyPlan
    path: Tensor  # [Rt, D + 1] accepted node at each depth (root first), -1 past the last
    num_nodes: Tensor  # [Rt] accepted nodes, root included = tokens the request emits
    tokens: Tensor  # [Rt, D + 1] emitted tokens: the accepted drafted tokens, then the bonus; -1 padded


def greedy_picks(logits: Tensor) -> Tensor:
    """The argmax of every row, the lowest index on ties (torch's rule, and numpy's): numpy's is
    vectorised on the CPU, torch's is not (about 15x slower on a tree's [17, 4096] logits)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)


def follow(tokens: np.ndarray, parents: np.ndarray, picks: np.ndarray, depth_bound: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """flashtree's accept walk (flashtree.tree.accept_walk) on host arrays: from the root, step to the
    lowest-index child whose token is the pick at the current node, until none is.

    tokens, parents, picks [R, N] (padding tokens -1). Returns (path, num_nodes, emitted tokens) as
    accept_walk does, widths depth_bound + 1. A tree has a few dozen nodes, where a dict per tree
    costs microseconds and every array op costs more.
    """
    R, N = tokens.shape
    path = np.full((R, depth_bound + 1), -1, dtype=np.int64)
    emitted = np.full_like(path, -1)
    num_nodes = np.empty(R, dtype=np.int64)
    for r, (tok, par, pk) in enumerate(zip(tokens.tolist(), parents.tolist(), picks.tolist())):
        child = {}
        for c in range(N - 1, 0, -1):  # from the last node down, so the lowest-index child wins
            if tok[c] >= 0 and par[c] >= 0:
                child[par[c], tok[c]] = c
        accepted = [0]
        while len(accepted) <= depth_bound:
            nxt = child.get((accepted[-1], pk[accepted[-1]]))
            if nxt is None:
                break
            accepted.append(nxt)
        n = len(accepted)
        path[r, :n] = accepted
        emitted[r, :n - 1] = [tok[i] for i in accepted[1:]]
        emitted[r, n - 1] = pk[accepted[-1]]
        num_nodes[r] = n
    return path, num_nodes, emitted


def walk(plan: VerifyPlan, logits: Tensor) -> Walked:
    """Pick the target's token at every node (argmax, or a Gumbel-max sample keyed by the request's seed
    and the position it predicts) and follow the picks down each tree: lossless for both."""
    if plan.greedy:
        picks = greedy_picks(logits)
    else:
        batch = SamplingBatch.build(plan.params, plan.seeds, logits.device)
        predicts = plan.prefix[:, None] + plan.spec.depths + 1
        picks = pick(logits, batch, predicts.to(logits.device), span=plan.spec.depth_bound + 1)
    path, num_nodes, tokens = follow(plan.spec.tokens.numpy(), plan.spec.parents.numpy(), picks.cpu().numpy(),
                                     plan.spec.depth_bound)
    return Walked(plan, torch.from_numpy(path), torch.from_numpy(num_nodes), torch.from_numpy(tokens))


def kv_moves(walked: Walked) -> tuple[Tensor, Tensor]:
    """(source token row, destination token row) for every accepted node whose K/V is not already at the
    slot of its path position: node path[k] of tree r moves to the slot vLLM gave row start[r] + k."""
    path, num_nodes, start = walked.path.numpy(), walked.num_nodes.numpy(), walked.plan.start.numpy()
    k = np.arange(path.shape[1])
    r, depth = np.nonzero((k >= 1) & (k < num_nodes[:, None]) & (path != k))
    return torch.from_numpy(start[r] + path[r, depth]), torch.from_numpy(start[r] + depth)


def on_spine(walked: Walked) -> bool:
    """Whether every accepted path is the first nodes in order, so nothing moves."""
    path = walked.path.numpy()
    k = np.arange(path.shape[1])
    return bool(((path == k) | (k >= walked.num_nodes.numpy()[:, None])).all())


def compact_kv(walked: Walked, move) -> None:
    """Copy the accepted nodes' K/V to the slots of their path positions in every target layer.

    move(caches, src_slots, dst_slots) copies within each layer's cache. Every source is read
    before any destination is written (a destination may be another node's source).
    """
    src, dst = kv_moves(walked)
    plan = walked.plan
    if src.numel() == 0 or plan.slot_mapping is None:
        return
    move(plan.caches, plan.slot_mapping[src].long(), plan.slot_mapping[dst].long())


def drafter_order(walked: Walked, num_tokens: int) -> Tensor:
    """A permutation of the batch's token rows that puts each tree's accepted path first, in path
    order, then its other nodes: the drafter then reads the accepted nodes' states at positions
    prefix..prefix+a, and the rejected ones after them, where they overwrite nothing it keeps."""
    plan = walked.plan
    valid, path = plan.valid.numpy(), walked.path.numpy()
    Rt, N = valid.shape
    node = np.arange(N)
    key = np.where(valid, N + node, 2 * N + node)
    r, depth = np.nonzero(path >= 0)
    key[r, path[r, depth]] = depth
    perm = key.argsort(axis=1, kind="stable")
    order = np.arange(num_tokens)
    order[plan.rows.numpy()[valid]] = (plan.start.numpy()[:, None] + perm)[valid]
    return torch.from_numpy(order)


def output_rows(sampled: Tensor, walked: Walked) -> Tensor:
    """vLLM's [R, width] accepted-tokens tensor with the trees' rows replaced by their walks."""
    tokens = walked.tokens.numpy()
    width = max(sampled.shape[1], tokens.shape[1])
    out = np.full((sampled.shape[0], width), -1, dtype=np.int64)
    out[:, :sampled.shape[1]] = sampled.numpy()
    rows = walked.plan.req_index.numpy()
    out[rows] = -1
    out[rows, :tokens.shape[1]] = tokens
    return torch.from_numpy(out).to(sampled.dtype)


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
