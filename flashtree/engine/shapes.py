"""The small fixed set of shapes a round (and a prefill chunk) is padded to, so compiled code and
CUDA graphs are built once per bucket instead of once per round.

- batch: powers of two; padded rows go to a dummy cache slot and their results are dropped;
- attended keys: multiples of 128 up to 1024, then powers of two, capped at the cache length
  (keys past a slot's window are masked, so padding them changes nothing);
- window: a tree budget from the grid the speculation policy (budget="auto") plans with (a fixed budget
  that fits is used as given), so every tree has 1 + budget nodes (build_tree pads short rows); a
  captured auto round's tree is a power of two (TREE_BUCKETS), each one a captured plan;
- prefill: chunks whose sizes are powers of two up to MAX_CHUNK (a prompt of 300 tokens runs as
  256 + 32 + 8 + 4), so no chunk needs padding and a chunk can be run on its own.
"""

from __future__ import annotations

from flashtree.engine.policy import GRID

MAX_CHUNK = 512
KEY_STEP = 128
FINE_KEYS = 1024
TREE_BUCKETS = tuple(1 << i for i in range(11))  # the tree sizes captured for budget="auto": 1 to 1024


def power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def batch_bucket(n: int) -> int:
    return power_of_two(n)


def key_bucket(n: int, cap: int) -> int:
    """Keys a window attends (committed prefix + window), rounded up; never past the cache.
    Multiples of KEY_STEP up to FINE_KEYS (short contexts waste little), powers of two past it."""
    if n <= FINE_KEYS:
        return min(cap, KEY_STEP * max(1, -(-n // KEY_STEP)))
    return min(cap, power_of_two(n))


def budget_bucket(budget: int, cap: int) -> int:
    """`budget` when it fits under `cap`, else the largest candidate budget that does."""
    if budget <= cap:
        return budget
    return max([b for b in GRID if b <= cap], default=1)


def prefill_chunks(start: int, end: int, static: bool) -> list[tuple[int, int]]:
    """[start, end) as consecutive chunks of at most MAX_CHUNK tokens; with `static`, each chunk's
    size is a power of two (the binary digits of the length, largest first)."""
    chunks = []
    while start < end:
        n = min(MAX_CHUNK, end - start)
        if static:
            n = 1 << (n.bit_length() - 1)
        chunks.append((start, start + n))
        start += n
    return chunks
