"""Draft trees as plain tensors: build, mask, walk. Knows no model."""
from flashtree.tree.build import build_chain, build_tree, build_tree_reference
from flashtree.tree.spec import TreeSpec, ancestor_mask, ancestor_table, chain_spec
from flashtree.tree.walk import WalkResult, accept_walk

__all__ = [
    "TreeSpec",
    "WalkResult",
    "accept_walk",
    "ancestor_mask",
    "ancestor_table",
    "build_chain",
    "build_tree",
    "build_tree_reference",
    "chain_spec",
]
