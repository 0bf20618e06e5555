"""flashtree's opaque operators: what a compiled graph calls where inductor must not look inside
(attention over the engine's cache, oneDNN's packed products).

They are plain `torch.library` operators: `torch.library.custom_op`'s per-call checks cost ~3 us,
a tenth of a demo layer's packed product, on every call of every compiled forward.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIB = torch.library.Library("flashtree", "DEF")


def opaque(schema: str, fn: Callable, fake: Callable) -> Callable:
    """flashtree::<schema> running `fn` on every device, traced through `fake` (output shapes only)."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"flashtree::{name}", fake, lib=_LIB)
    return getattr(torch.ops.flashtree, name).default
