from flashtree.engine.llm import LLM, RequestOutput
from flashtree.engine.llm_engine import EngineStats, LLMEngine, StepOutput
from flashtree.engine.sequence import Request

__all__ = ["LLM", "LLMEngine", "RequestOutput", "StepOutput", "EngineStats", "Request"]
