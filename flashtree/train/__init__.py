"""Training: the demo target's data (corpus, tokenizer, pretrain) and the DFlash drafter pipeline.

    from flashtree.train import regenerate, extract, train, evaluate, build_demo

Names load lazily so that importing one stage never pulls in the others.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RegenerateConfig": "responses", "regenerate": "responses",
    "ExtractConfig": "features", "extract": "features", "FeatureShards": "features",
    "TrainConfig": "trainer", "train": "trainer",
    "EvalConfig": "tau", "evaluate": "tau",
    "DemoConfig": "demo", "build_demo": "demo",
    "BlockDrafter": "blocks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"flashtree.train.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'flashtree.train' has no attribute {name!r}")
