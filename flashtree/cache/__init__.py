"""Engine-owned caches: the K/V cache, a hybrid target's recurrent state, the drafter's ring."""

from flashtree.cache.draft_ring import SlidingDraftCache
from flashtree.cache.hybrid import HybridCache, RecurrentState
from flashtree.cache.kv import KVCache

__all__ = ["HybridCache", "KVCache", "RecurrentState", "SlidingDraftCache"]
