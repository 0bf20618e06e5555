"""OpenAI-compatible HTTP server over LLMEngine: `flashtree serve`, or `build_app(engine)`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtree.lazy import lazy_exports

if TYPE_CHECKING:
    from flashtree.server.app import build_app
    from flashtree.server.background import BackgroundServer

__all__ = ["build_app", "BackgroundServer"]
__getattr__ = lazy_exports(__name__, {"build_app": "flashtree.server.app",
                                      "BackgroundServer": "flashtree.server.background"})
