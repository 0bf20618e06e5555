"""The DFlash drafter in a DDTree run: its per-position logits are kept for the tree builder, and its
context keys are normalised per layer.

vLLM 0.32 normalises the context keys of every drafter layer in one `ops.rms_norm` call with
the layers' k_norm weights stacked [layers, head_dim]; on the CPU that op applies layer 0's
weights to every layer. The chain barely notices (its argmax seldom changes); a tree, which
ranks the drafter's lower candidates too, does. DDTree runs normalise each layer with its own
weights, as the drafter was trained.
"""
from __future__ import annotations

import torch
from torch import nn
from vllm import _custom_ops as ops
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
from vllm.v1.spec_decode.dflash import DFlashProposer

from flashtree.integrations.vllm.patching import VllmPatch


def exact_context_keys(model: nn.Module) -> None:
    """Mark the drafter's DFlash models for per-layer key normalisation."""
    for module in model.modules():
        if isinstance(module, DFlashQwen3Model):
            module._flashtree_per_layer_k_norm = True


class DFlashProposerPatch(VllmPatch, target=DFlashProposer):
    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        ddtree = getattr(self, "_flashtree_ddtree", None)
        if ddtree is None:
            return DFlashProposerPatch.original(self, "_sample_draft_tokens")(hidden_states, sampling_metadata)
        logits = self.model.compute_logits(hidden_states)
        ddtree.draft_logits = logits
        chains = ddtree.chain_rows(logits.shape[0])
        if chains is None:
            return logits.argmax(dim=-1), None
        ids = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        if chains.any():  # trees come from the logits; only chain requests need their argmax
            chains = chains.to(logits.device)
            ids[chains] = logits[chains].argmax(dim=-1)
        return ids, None


class DFlashQwen3ModelPatch(VllmPatch, target=DFlashQwen3Model):
    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "_flashtree_per_layer_k_norm", False):
            return DFlashQwen3ModelPatch.original(self, "_normalize_context_k")(all_k)
        normed = torch.empty_like(all_k)
        for layer in range(all_k.shape[0]):
            ops.rms_norm(normed[layer], all_k[layer], self._k_norm_weights[layer], self._rms_norm_eps)
        return normed
