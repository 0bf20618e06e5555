"""Which requests draft trees, and the trees they drafted, kept from the draft step to the verify step.

vLLM's scheduler sees a tree as a plain list of draft tokens: the drafted nodes in flashtree's
order (by depth, then rank), so every prefix of the list is a tree and a list the scheduler cuts
short still verifies. The runner keeps each list's parents and depths until the verify step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashtree.errors import FlashtreeError
from flashtree.sampler import fresh_seed
from flashtree.sampling import SamplingParams
from flashtree.tree import build_tree

SAMPLING_EPS = 1e-5  # vLLM treats a temperature below this as greedy
RAW_LOGPROBS = ("raw_logprobs", "raw_logits")  # logprobs of the raw logits: a row gather at the accepted nodes


@dataclass
class DraftTree:
    tokens: list[int]  # drafted nodes' tokens (root excluded): the draft list the scheduler gets
    parents: np.ndarray  # [1 + len(tokens)] int64, root -1
    depths: np.ndarray  # [1 + len(tokens)] int64, root 0


def tree_params(params: Any, logprobs_mode: str) -> SamplingParams | None:
    """flashtree's sampling parameters for a vLLM request that can verify a tree, or None when it needs
    the chain: structured output, penalties, bad words, min_tokens, logit bias, allowed tokens, min_p,
    a thinking budget, watermarking, per-token logprob ids, or processed logprobs, which all assume
    the drafts form one sequence or change the distribution the walk samples from."""
    if (params.structured_outputs is not None or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0 or params.bad_words or params.min_tokens > 0 or params.logit_bias
            or params.allowed_token_ids or params.min_p > SAMPLING_EPS or params.thinking_token_budget is not None
            or params.watermarking or params.logprob_token_ids or getattr(params, "repetition_detection", None)):
        return None
    if params.logprobs is not None and logprobs_mode not in RAW_LOGPROBS:
        return None
    greedy = params.temperature < SAMPLING_EPS
    try:
        return SamplingParams(temperature=0.0 if greedy else params.temperature, top_p=params.top_p,
                              top_k=max(params.top_k, 0), seed=params.seed)
    except FlashtreeError:
        return None  # a setting flashtree's sampler does not take (e.g. temperature > 100): vLLM's chain


class TreeBook:
    """The trees drafted at one step for the next, and the seeds of unseeded sampling requests.

    flashtree samples every node with noise hashed from (seed, position, token), so a request
    without a seed gets a fresh one, drawn once and kept while it runs.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.trees: dict[str, DraftTree] = {}
        self.params: dict[str, SamplingParams] = {}
        self.seeds: dict[str, int] = {}

    def take(self) -> tuple[dict[str, DraftTree], dict[str, SamplingParams]]:
        """The trees drafted last step (and their requests' parameters); the book starts empty again."""
        trees, params = self.trees, self.params
        self.trees, self.params = {}, {}
        return trees, params

    def seed(self, req_id: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        if req_id not in self.seeds:
            self.seeds[req_id] = fresh_seed()
        return self.seeds[req_id]

    def forget(self, live: set[str]) -> None:
        """Drop the seeds of requests that left the engine."""
        for req_id in [r for r in self.seeds if r not in live]:
            del self.seeds[req_id]

    def draft(self, req_ids: list[str], rows: list[int], params: list[SamplingParams], roots: torch.Tensor,
              logits: torch.Tensor, chains: list[list[int]]) -> list[list[int]]:
        """Replace the chains of `rows` (batch rows of requests that verify trees) by their exact top-budget
        trees built from the drafter's logits [R, depth, V]; remember each tree for the verify step."""
        if not rows:
            return chains
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        spec = build_tree(roots[index], logits[index], self.budget)
        tokens = spec.tokens.cpu().numpy()
        parents = spec.parents.cpu().numpy()
        depths = spec.depths.cpu().numpy()
        for j, (i, p, size) in enumerate(zip(rows, params, spec.sizes.tolist())):
            tree = DraftTree(tokens[j, 1:size].tolist(), parents[j, :size].copy(), depths[j, :size].copy())
            self.trees[req_ids[i]] = tree
            self.params[req_ids[i]] = p
            chains[i] = tree.tokens
        return chains
