"""The scheduler of a DDTree run: vLLM's own, with speculative-decoding stats that count tree nodes.

A tree schedules up to `budget` draft tokens while the drafter drafts `num_speculative_tokens`
positions, and vLLM's per-position draft counters have one slot per position. Stats count every
node as a draft token and the positions a tree can fill at most once each; accepted tokens per
position are exact, since the accepted path is an ordinary chain.
"""
from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class DDTreeScheduler(Scheduler):
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        positions = min(num_draft_tokens, self.num_spec_tokens)
        stats = super().make_spec_decoding_stats(spec_decoding_stats, positions, num_accepted_tokens,
                                                 num_invalid_spec_tokens, request_id)
        if stats is not None:
            stats.num_draft_tokens += num_draft_tokens - positions
        return stats
