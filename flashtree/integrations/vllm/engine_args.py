"""The one patch the plugin installs in every process: a look at the config vLLM is about to run.

A run without additional_config['ddtree'] gets vLLM's config back untouched. A DDTree run is
checked (settings.validate) and handed to flashtree's worker, which applies the other patches
in the processes that run the model, and to flashtree's scheduler (scheduler.py).
"""
from __future__ import annotations

import logging
from typing import Any

from vllm.engine.arg_utils import EngineArgs

from flashtree.integrations.vllm import settings
from flashtree.integrations.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.flashtree")


class EngineArgsPatch(VllmPatch, target=EngineArgs):
    def create_engine_config(self, *args: Any, **kwargs: Any):
        config = EngineArgsPatch.original(self, "create_engine_config")(*args, **kwargs)
        if settings.requested(config.additional_config):
            chosen = settings.validate(config)
            config.parallel_config.worker_cls = settings.DDTREE_WORKER
            config.scheduler_config.scheduler_cls = settings.DDTREE_SCHEDULER
            logger.info("flashtree DDTree: exact top-%d draft trees from the DFlash drafter (depth %d)",
                        chosen.budget, chosen.depth)
        return config
