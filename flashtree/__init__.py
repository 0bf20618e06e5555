"""flashtree: lossless LLM decoding with DFlash drafters and DDTree draft trees."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtree.config import EngineConfig
from flashtree.errors import FlashtreeError
from flashtree.lazy import lazy_exports
from flashtree.sampling import SamplingParams

if TYPE_CHECKING:
    from flashtree.engine import LLM, LLMEngine, RequestOutput

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams", "FlashtreeError"]
__version__ = "0.1.0"
# The engine (torch, transformers) loads when first named: the CLI answers --version without it.
__getattr__ = lazy_exports(__name__, dict.fromkeys(["LLM", "LLMEngine", "RequestOutput"], "flashtree.engine"))
