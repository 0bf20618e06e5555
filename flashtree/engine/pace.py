"""One warning when rounds run far slower than the start-up cost measurement predicted.

With more torch threads than free cores (a busy or shared machine), every op's threads wait
on each other and a run can take ten times what one thread takes, with nothing to say why.
The policy's cost model predicts each round's seconds (budget="auto"), so a typical round
several times slower than predicted, on the CPU with several threads, is that case.
"""

from __future__ import annotations

import logging
import statistics

import torch

log = logging.getLogger("flashtree")

SKIP = 4  # first rounds left out: allocator and first-call warm-up
ROUNDS = 16  # rounds judged after those
SLOWER = 4.0  # median actual / predicted that warns (predictions are best-of-n: ordinary rounds run a little above)


class PaceWatch:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ratios: list[float] = []
        self.seen = 0
        self.warned: str | None = None

    def observe(self, seconds: float, predicted: float) -> None:
        """A round took `seconds`; the plan predicted `predicted` (0: no prediction)."""
        if predicted <= 0 or len(self.ratios) >= ROUNDS or self.device.type != "cpu":
            return
        self.seen += 1
        if self.seen <= SKIP:
            return
        self.ratios.append(seconds / predicted)
        threads = torch.get_num_threads()
        if len(self.ratios) == ROUNDS and (slower := statistics.median(self.ratios)) > SLOWER and threads > 1:
            self.warned = (f"flashtree: warning: rounds take {slower:.1f}x the time the start-up cost measurement "
                           f"predicted, with {threads} torch threads; the CPU is likely oversubscribed (other jobs, "
                           "or more threads than free cores): use --threads 1 (torch.set_num_threads(1))")
            log.warning(self.warned)
