"""Package attributes imported on first use (PEP 562), so that `flashtree --version`, `--help`
and `import flashtree.config` do not pay for torch, transformers and FastAPI."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: name -> the module it lives in."""

    def __getattr__(name: str):
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
