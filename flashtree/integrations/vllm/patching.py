"""Patches of vLLM classes, in the style of Snowflake's Arctic Inference plugin.

A patch is a small class named after the vLLM class it changes, declared as
`class FooPatch(VllmPatch, target=Foo)`. `FooPatch.apply()` copies its methods onto Foo once
(applying twice is a no-op, as vLLM may load a plugin more than once per process), and a patched
method reaches the method it replaced through `FooPatch.original(self, "name")`.
"""
from __future__ import annotations

from typing import Any, ClassVar

_SKIP = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
         "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__"}


class VllmPatch:
    _target: ClassVar[type]
    _originals: ClassVar[dict[str, Any]]
    _applied: ClassVar[bool]

    def __init_subclass__(cls, target: type, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._target = target
        cls._originals = {}
        cls._applied = False

    @classmethod
    def apply(cls) -> None:
        """Install the patch's methods on the target class; later calls do nothing."""
        if cls._applied:
            return
        for name, value in vars(cls).items():
            if name in _SKIP or name.startswith("_VllmPatch") or name in ("_target", "_originals", "_applied"):
                continue
            cls._originals[name] = getattr(cls._target, name, None)
            setattr(cls._target, name, value)
        cls._applied = True

    @classmethod
    def original(cls, obj: Any, name: str) -> Any:
        """The target's method `name` as it was before the patch, bound to obj."""
        return cls._originals[name].__get__(obj, cls._target)

    @classmethod
    def is_applied(cls) -> bool:
        return cls._applied


def replace_function(module: Any, name: str, function: Any) -> None:
    """Point `module.name` at `function`, once; the replaced function stays reachable as function.__wrapped__."""
    current = getattr(module, name)
    if current is function:
        return
    function.__wrapped__ = current
    setattr(module, name, function)
