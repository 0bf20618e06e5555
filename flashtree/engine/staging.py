"""Host lists sent to the device in one copy: the per-round index lists and floats of a plan.

Like the runner's InputStage, each dtype lives in one fixed host buffer (pinned on CUDA) that is
copied with one non-blocking copy into a fixed device buffer; the named lists come back as
device views. Reusing the buffers is safe for the same reason: the previous round's copy
finished before that round's one read returned.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class _Buffer:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=dtype, pin_memory=on_cuda)
        self.view = self.host.numpy()
        self.device = torch.empty(size, dtype=dtype, device=device) if device.type != "cpu" else self.host

    def grow(self, size: int) -> None:
        if size > self.host.numel():
            self.__init__(max(size, 2 * self.host.numel()), self.host.dtype, self.device.device)


class Staging:
    def __init__(self, device: torch.device, size: int = 1024) -> None:
        self.longs = _Buffer(size, torch.long, device)
        self.floats = _Buffer(size, torch.float32, device)

    def upload(self, longs: dict[str, list[int]], floats: dict[str, np.ndarray] | None = None) -> dict[str, Tensor]:
        """Device views of every named list (floats keep their numpy shape)."""
        out: dict[str, Tensor] = {}
        for buf, items, as_array in ((self.longs, longs, False), (self.floats, floats or {}, True)):
            sizes = {k: (np.asarray(v).size if as_array else len(v)) for k, v in items.items()}
            total = sum(sizes.values())
            if total == 0:
                continue
            buf.grow(total)
            offset, views = 0, {}
            for name, v in items.items():
                n = sizes[name]
                buf.view[offset : offset + n] = np.asarray(v).reshape(-1)
                views[name] = (offset, n, np.asarray(v).shape if as_array else (n,))
                offset += n
            if buf.device is not buf.host:
                buf.device[:total].copy_(buf.host[:total], non_blocking=True)
            for name, (o, n, shape) in views.items():
                out[name] = buf.device[o : o + n].view(shape)
        return out
