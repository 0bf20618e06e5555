"""DDTree inside vLLM: a vLLM general plugin that turns vLLM's DFlash chain into flashtree's exact
draft trees, verified in one target forward and walked losslessly.

Turn it on with `additional_config={"ddtree": {"budget": 64}}` next to a DFlash
speculative_config (docs/vllm.md). The plugin supports vLLM 0.32.x; on any other version it logs
one line and leaves vLLM untouched.
"""
from __future__ import annotations

import logging

SUPPORTED = "0.32."
logger = logging.getLogger("vllm.flashtree")
_loaded = False


def register() -> None:
    """The `vllm.general_plugins` entry point. vLLM calls it in every process, maybe more than once."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import vllm

    if not vllm.__version__.startswith(SUPPORTED):
        logger.warning("flashtree's DDTree plugin supports vLLM %sx, not %s; it leaves vLLM untouched",
                       SUPPORTED, vllm.__version__)
        return
    from flashtree.integrations.vllm.engine_args import EngineArgsPatch

    EngineArgsPatch.apply()
