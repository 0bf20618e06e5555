"""The worker of a DDTree run: vLLM's CPU worker, with flashtree's patches applied in its process
before it builds the model runner. settings.validate() puts it in the run's config."""
from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from flashtree.integrations.vllm.runner import apply_patches


class DDTreeCPUWorker(CPUWorker):
    def __init__(self, *args, **kwargs) -> None:
        apply_patches()
        super().__init__(*args, **kwargs)
