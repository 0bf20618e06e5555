"""flashtree: lossless LLM decoding with DFlash drafters and DDTree draft trees."""

from flashtree.config import EngineConfig
from flashtree.engine import LLM, LLMEngine, RequestOutput
from flashtree.errors import FlashtreeError
from flashtree.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams", "FlashtreeError"]
__version__ = "0.1.0"
