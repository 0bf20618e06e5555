from flashtree.engine.llm import LLM, RequestOutput
from flashtree.engine.llm_engine import LLMEngine, StepOutput

__all__ = ["LLM", "LLMEngine", "RequestOutput", "StepOutput"]
