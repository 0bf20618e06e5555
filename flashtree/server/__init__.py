"""OpenAI-compatible HTTP server over LLMEngine: `flashtree serve`, or `build_app(engine)`."""

from flashtree.server.app import build_app
from flashtree.server.background import BackgroundServer

__all__ = ["build_app", "BackgroundServer"]
