"""The part of a verify step that vLLM's own rejection sampler keeps: every request that verifies a chain
(or nothing), and each tree request's root row, which the sampler treats as a request without drafts
(its result is replaced by the tree's walk)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from vllm.v1.sample import rejection_sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from flashtree.integrations.vllm.patching import replace_function


def _starts(lengths: np.ndarray) -> np.ndarray:
    return np.cumsum(lengths) - lengths


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated [start, start + length) ranges."""
    total = int(lengths.sum())
    return np.repeat(starts, lengths) + np.arange(total) - np.repeat(_starts(lengths), lengths)


def chain_part(metadata: SpecDecodeMetadata, tree_index: np.ndarray) -> tuple[SpecDecodeMetadata, np.ndarray]:
    """The metadata of the batch with the trees' drafts removed, and the logits rows it keeps."""
    drafts = np.asarray(metadata.num_draft_tokens, dtype=np.int64)
    kept = drafts.copy()
    kept[tree_index] = 0
    rows = _ranges(_starts(drafts + 1), kept + 1)
    is_tree = np.zeros(len(drafts), dtype=bool)
    is_tree[tree_index] = True
    keep_drafts = torch.from_numpy(~np.repeat(is_tree, drafts))
    cu_drafts, cu_sampled = np.cumsum(kept), np.cumsum(kept + 1)
    device = metadata.draft_token_ids.device

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)

    part = SpecDecodeMetadata(
        draft_token_ids=metadata.draft_token_ids[keep_drafts.to(device)].contiguous(),
        num_draft_tokens=kept.tolist(),
        cu_num_draft_tokens=tensor(cu_drafts),
        cu_num_sampled_tokens=tensor(cu_sampled),
        target_logits_indices=tensor(_ranges(cu_sampled - kept - 1, kept)),
        bonus_logits_indices=tensor(cu_sampled - 1),
        logits_indices=metadata.logits_indices[tensor(rows).long()],
    )
    return part, rows


def chain_sampling_metadata(sampling_metadata, tree_index: np.ndarray):
    """vLLM's sampling metadata with the trees' draft lists emptied, matching chain_part's counts
    (penalties, bad words and the thinking budget walk the drafts request by request)."""
    spec = sampling_metadata.spec_token_ids
    if spec is None:
        return sampling_metadata
    trees = set(tree_index.tolist())
    return replace(sampling_metadata, spec_token_ids=[[] if i in trees else s for i, s in enumerate(spec)])


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0,
                           replace_to: int = 0) -> torch.Tensor:
    """Each request's value repeated over its draft tokens (replace_from swapped for replace_to).

    Stands in for vLLM 0.32's version, whose CPU kernel writes into an int64 copy of its output
    whenever the values are not int64 (temperatures, top-p, int32 top-k), so the drafts of a
    sampled chain were judged under uninitialised parameters.
    """
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    out = x.repeat_interleave(counts, output_size=num_tokens)
    return out.masked_fill(out == replace_from, replace_to)


def fix_chain_sampling() -> None:
    replace_function(rejection_sampler, "expand_batch_to_tokens", expand_batch_to_tokens)
