from flashtree.engine.llm import LLM, CompletionOutput, RequestOutput
from flashtree.engine.llm_engine import EngineStats, LLMEngine, StepOutput
from flashtree.engine.sequence import Request, RequestGroup, TokenLogprob

__all__ = ["LLM", "LLMEngine", "RequestOutput", "CompletionOutput", "StepOutput", "EngineStats", "Request", "RequestGroup",
           "TokenLogprob"]
