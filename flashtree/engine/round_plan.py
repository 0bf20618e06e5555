"""What one round does, per batch row: a plain AR step, the chain or a tree. Every method's rounds
run one (a fixed method's from fixed_plan, budget="auto"'s from the policy), so it lives apart from
the policy that fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashtree.engine.cost_model import CONTEXT

AR, CHAIN, TREE = 0, 1, 2
MODE_NAMES = ("ar", "chain", "tree")


@dataclass
class RoundPlan:
    """What one round does, per batch row, and what the policy expects of it."""

    modes: list[int]  # AR, CHAIN or TREE per batch row
    window: int = 1  # nodes per row in the verify (root included)
    budget: int = 0  # tree rows' drafted nodes
    chain: int = 0  # chain rows' drafted nodes
    depth: int = 0  # draft positions the LM head scores
    draft_rows: list[int] = field(default_factory=list)
    tree_rows: int = 0  # every drafting row of a tree plan (trees and chains do not mix)
    predicted: list[float] = field(default_factory=list)  # per row: expected accepted drafted tokens
    seconds: float = 0.0
    arm: int | None = None  # auto: the grid index of the tree, or CHAIN_ARM; None for AR steps
    measure: int = 0  # tree sizes (grid columns) whose accepted tokens the round reads back
    explored: bool = False  # auto: played to measure, paid from the exploration credit ...
    baseline: float = 0.0  # ... for what it lost against this rate (tokens a second) of the plan it displaced
    keys: int = CONTEXT  # committed keys behind the batch's deepest row, which every row's attention spans
    sampled: int = 0  # rows drawn by seeded noise rather than argmax (each pays it at every node)

    @property
    def drafting(self) -> int:
        return len(self.draft_rows)

    def label(self, row: int) -> str:
        return MODE_NAMES[self.modes[row]]

    def size(self, row: int) -> int:
        """Drafted nodes the row verifies (0 for AR)."""
        return {AR: 0, CHAIN: self.chain, TREE: self.budget}[self.modes[row]]


def fixed_plan(rows: int, method: str, block_size: int, budget: int) -> RoundPlan:
    """Every row drafts alike: the chain (dflash), a tree of `budget` nodes (ddtree) or nothing (ar)."""
    if method == "ar":
        return RoundPlan([AR] * rows, predicted=[0.0] * rows)
    if method == "dflash":
        return RoundPlan([CHAIN] * rows, window=block_size, chain=block_size - 1, depth=block_size - 1,
                         draft_rows=list(range(rows)), predicted=[0.0] * rows)
    return RoundPlan([TREE] * rows, window=budget + 1, budget=budget, depth=min(budget, block_size - 1),
                     draft_rows=list(range(rows)), tree_rows=rows, predicted=[0.0] * rows)
