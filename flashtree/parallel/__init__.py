"""Tensor parallelism: the target split over N ranks (flashtree starts the N - 1 worker processes).

shard.py cuts the model to a rank's slice before its weights are read; workers.py runs the
worker processes and their control pipes; mirror.py is rank 0's runner that they follow.
"""

from flashtree.parallel.group import TensorParallel
from flashtree.parallel.workers import EngineLink, open_engine

__all__ = ["EngineLink", "TensorParallel", "open_engine"]
