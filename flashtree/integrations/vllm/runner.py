"""DDTree inside vLLM's V1 model runner (the CPU runner) and its DFlash drafter.

One step, as vLLM runs it, with what these patches change:
- `_prepare_inputs`: requests whose scheduled drafts are the tree they drafted move each node
  to position prefix + depth (their slots stay prefix + node index).
- `_model_forward`: the target forward attends those rows under the ancestor mask (attention.py).
- `_sample`: vLLM's rejection sampler runs on the chain requests; each tree is walked by
  flashtree, its accepted K/V compacted to the path's slots, and its row written as an ordinary
  accepted chain, so vLLM's bookkeeping, rollback and stats need nothing new.
- `propose_draft_token_ids`: the drafter reads the accepted path's states first; from its
  per-position logits, flashtree builds each request's exact top-budget tree, handed to the
  scheduler as a draft list.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from vllm.v1.outputs import SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from flashtree.integrations.vllm import attention, drafter, settings
from flashtree.integrations.vllm.accept import Walked, drafter_order, merge_logprobs, on_spine, output_rows, walk
from flashtree.integrations.vllm.chain import chain_part, chain_sampling_metadata, fix_chain_sampling
from flashtree.integrations.vllm.patching import VllmPatch
from flashtree.integrations.vllm.trees import TreeBook, tree_params
from flashtree.integrations.vllm.verify import VerifyPlan, plan_verify
from flashtree.sampling import SamplingParams


class DDTreeRunner:
    """A model runner's DDTree state: the trees drafted for the next step, this step's plan and walk,
    and the drafter logits of the step in flight."""

    def __init__(self, chosen: settings.DDTreeSettings, logprobs_mode: str) -> None:
        self.settings = chosen
        self.book = TreeBook(chosen.budget)
        self.logprobs_mode = logprobs_mode
        self.plan: VerifyPlan | None = None
        self.walked: Walked | None = None
        self.draft_logits: Tensor | None = None
        self.tree_rows: list[int] = []  # batch rows drafting trees this step; the rest draft chains
        self.tree_params: list[SamplingParams] = []
        self._params: dict[str, SamplingParams | None] = {}  # per request, read once: params never change

    def choose(self, runner: CPUModelRunner, num_reqs: int) -> None:
        """Which requests of the batch draft trees this step: those whose sampling allows one and whose
        prefill is complete."""
        if len(self._params) > 2 * len(runner.requests):
            self._params = {r: p for r, p in self._params.items() if r in runner.requests}
            self.book.forget(set(runner.requests))
        discarded = runner.discard_request_mask.np[:num_reqs]
        self.tree_rows, self.tree_params = [], []
        for i, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            if req_id not in self._params:
                self._params[req_id] = tree_params(runner.requests[req_id].sampling_params, self.logprobs_mode)
            p = self._params[req_id]
            if p is not None and not discarded[i]:
                self.tree_rows.append(i)
                self.tree_params.append(p)

    def chain_rows(self, total: int) -> Tensor | None:
        """Rows of the drafter's [requests * depth] logits whose argmax chains are drafts; None for all,
        an empty tensor for none."""
        if not self.tree_rows:
            return None
        requests = total // self.settings.depth
        if len(self.tree_rows) == requests:
            return torch.empty(0, dtype=torch.bool)
        keep = np.ones(requests, dtype=bool)
        keep[self.tree_rows] = False
        return torch.from_numpy(np.repeat(keep, self.settings.depth))

    def draft(self, runner: CPUModelRunner, chains: Tensor, sampled: Tensor, logits: Tensor) -> list[list[int]]:
        """Each request's draft list: its exact tree when its sampling allows one, else vLLM's chain."""
        R, depth = chains.shape
        accepted = sampled.cpu().numpy()
        last = np.maximum((accepted != -1).sum(1) - 1, 0)
        roots = torch.from_numpy(accepted[np.arange(R), last].astype(np.int64))
        return self.book.draft(runner.input_batch.req_ids[:R], self.tree_rows, self.tree_params, roots,
                               logits.view(R, depth, -1), chains.tolist())


class CPUModelRunnerPatch(VllmPatch, target=CPUModelRunner):
    # Runners built before the patch was applied (another engine in the same process) are vLLM's.
    _flashtree_ddtree: DDTreeRunner | None = None

    def __init__(self, vllm_config, device) -> None:
        CPUModelRunnerPatch.original(self, "__init__")(vllm_config, device)
        chosen = settings.settings_of(vllm_config)
        self._flashtree_ddtree = None if chosen is None else DDTreeRunner(chosen, self.model_config.logprobs_mode)
        if chosen is not None:
            self.drafter._flashtree_ddtree = self._flashtree_ddtree

    def load_model(self, *args, **kwargs) -> None:
        CPUModelRunnerPatch.original(self, "load_model")(*args, **kwargs)
        if self._flashtree_ddtree is not None:
            drafter.exact_context_keys(self.drafter.model)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = CPUModelRunnerPatch.original(self, "_prepare_inputs")(scheduler_output, num_scheduled_tokens)
        ddtree = self._flashtree_ddtree
        if ddtree is not None:
            ddtree.walked = None
            ddtree.plan = plan_verify(ddtree.book, scheduler_output.scheduled_spec_decode_tokens,
                                      self.input_batch.req_id_to_index, self.query_start_loc.np,
                                      self.input_batch.num_computed_tokens_cpu, self.input_ids.cpu)
            if ddtree.plan is not None:
                rows, positions = ddtree.plan.positions()
                self.positions[rows.to(self.positions.device)] = positions.to(self.positions.device)
        return result

    def _model_forward(self, *args, **kwargs):
        original = CPUModelRunnerPatch.original(self, "_model_forward")
        plan = None if self._flashtree_ddtree is None else self._flashtree_ddtree.plan
        if plan is None:
            return original(*args, **kwargs)
        with attention.verifying(plan):
            return original(*args, **kwargs)

    def _sample(self, logits, spec_decode_metadata):
        ddtree = self._flashtree_ddtree
        plan = None if ddtree is None else ddtree.plan
        if ddtree is None or spec_decode_metadata is None:
            return CPUModelRunnerPatch.original(self, "_sample")(logits, spec_decode_metadata)
        ddtree.plan = None
        self.input_batch.update_async_output_token_ids()
        sampling = self.input_batch.sampling_metadata
        if plan is None:
            return chain_sample(self, logits, spec_decode_metadata, sampling)
        trees = plan.req_index.numpy()
        drafts = np.asarray(spec_decode_metadata.num_draft_tokens)
        starts = (np.cumsum(drafts + 1) - drafts - 1)[trees]
        logits_start = torch.from_numpy(starts)
        walked = walk(plan, tree_logits(logits, starts, plan.size.numpy(), plan.rows.shape[1]))

        if len(trees) == len(drafts) and sampling.max_num_logprobs is None:  # every row is a tree's walk
            out = SamplerOutput(sampled_token_ids=torch.full((len(drafts), 1), -1, dtype=torch.int32),
                                logprobs_tensors=None)
        else:
            part, rows = chain_part(spec_decode_metadata, trees)
            out = chain_sample(self, logits[torch.from_numpy(rows).to(logits.device)], part,
                               chain_sampling_metadata(sampling, trees))
        attention.compact(walked)
        ddtree.walked = walked
        logprobs = out.logprobs_tensors
        if logprobs is not None:
            logprobs = merge_logprobs(logprobs, out.sampled_token_ids.shape[1], walked, logits, logits_start,
                                      ddtree.logprobs_mode == "raw_logits", self.sampler.gather_logprobs)
        return SamplerOutput(sampled_token_ids=output_rows(out.sampled_token_ids, walked), logprobs_tensors=logprobs)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        original = CPUModelRunnerPatch.original(self, "propose_draft_token_ids")
        ddtree = self._flashtree_ddtree
        if ddtree is None:
            return original(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                            sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                            slot_mappings)
        walked, ddtree.walked = ddtree.walked, None
        if walked is not None:
            rows, positions = walked.plan.chain_positions()
            self.positions[rows.to(self.positions.device)] = positions.to(self.positions.device)
            if not on_spine(walked):
                order = drafter_order(walked, scheduler_output.total_num_scheduled_tokens).to(self.device)
                aux_hidden_states = [h[order] for h in aux_hidden_states]
        ddtree.draft_logits = None
        ddtree.choose(self, self.input_batch.num_reqs)
        chains = original(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                          sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                          slot_mappings)
        logits, ddtree.draft_logits = ddtree.draft_logits, None
        if logits is None or not torch.is_tensor(chains) or not torch.is_tensor(sampled_token_ids):
            return chains
        return ddtree.draft(self, chains, sampled_token_ids, logits)


def tree_logits(logits: Tensor, starts: np.ndarray, sizes: np.ndarray, N: int) -> Tensor:
    """[Rt, N, V] the target's logits at every tree node (a cut tree repeats its last node's row): a view
    when the trees' rows follow each other, all N long, as at batch size 1."""
    if (sizes == N).all() and (np.diff(starts) == N).all():
        return logits[int(starts[0]):int(starts[0]) + len(starts) * N].view(len(starts), N, -1)
    node = np.minimum(np.arange(N), sizes[:, None] - 1)
    return logits[torch.from_numpy(starts[:, None] + node).to(logits.device)]


def chain_sample(runner: CPUModelRunner, logits: Tensor, metadata, sampling) -> SamplerOutput:
    """vLLM's own sampling of the requests that verify chains. Without any draft in the batch it is one
    plain sample per request, as vLLM samples without speculation: vLLM 0.32's rejection sampler
    fails on a top-k request when no request has drafts (no rows to apply the top-k to)."""
    if metadata.max_spec_len == 0:
        return runner.sampler(logits=logits, sampling_metadata=sampling)
    return runner.rejection_sampler(metadata, None, logits, sampling)


PATCHES = (CPUModelRunnerPatch, drafter.DFlashProposerPatch, drafter.DFlashQwen3ModelPatch,
           attention.CPUAttentionBackendImplPatch, attention.CPUAttentionMetadataBuilderPatch)


def apply_patches() -> None:
    for patch in PATCHES:
        patch.apply()
    fix_chain_sampling()
