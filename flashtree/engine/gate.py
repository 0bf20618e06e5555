"""Measured, not modelled: does drafting beat AR steps for this kind of batch?

The policy's forecasts decide per round from the previous round's draft. Where acceptance comes
in long streaks (greedy text falling into a copy, then leaving it), a forecast that turned cold
sends a request to AR steps, which show nothing about when the next streak starts, and the
policy can sit out the rounds that would have paid most. The gate watches what drafting rounds
actually delivered against what AR steps cost, per (sampling class, batch-size bucket): once
enough drafting rounds of a kind have beaten AR by a clear margin, that kind of batch keeps
drafting (the policy still picks who drafts and how big); when they stop beating it, the gate
steps aside and the forecasts decide again, unless they have lost to AR on average: then the
batch stays on AR steps apart from the forecasts' probes. A class not seen yet drafts its first MIN_ROUNDS
rounds, so that both the gate and the forecasts start from evidence rather than priors. The same
measurement per window size corrects the forecast's size where it has measurably done worse
than another size (`column`).

    ratio = (tokens the round emitted / its seconds) / (rows / an AR round's seconds)

both seconds the cost model's (measured at startup, refined online from timed rounds), so the
ratio compares realized tokens at one set of prices.

The ratio is kept as a slow exponential average of its log over drafting rounds whose rows share
a class (a running mean over the first 1/RATE rounds): it must average over streaks, or a cold
stretch would switch the gate off and, with drafting stopped, nothing would switch it back on.
"""

from __future__ import annotations

import math

MIN_ROUNDS = 8  # drafting rounds a kind explores with before its measured ratio decides
MARGIN = 1.1  # drafting must beat AR by this much (its average realized ratio), or lose by it
LOSE_ROUNDS = 24  # drafting rounds of a batch size before its losses overrule the forecasts
SIZE_MARGIN = 1.03  # a measured window size must beat the forecast's pick by this much to replace it
RATE = 0.02  # EMA weight of one round: the average spans streaks (tens of rounds), not one of them


def bucket(rows: int) -> int:
    """Batch sizes pooled together: 1, 2, 4, 8, ... (a round of 3 counts with those of 4)."""
    return 1 << max(0, rows - 1).bit_length()


class Gate:
    def __init__(self) -> None:
        # (class,), (class, bucket), (class, bucket, window column) -> average log ratio, rounds seen
        self.log_ratio: dict[tuple, float] = {}
        self.rounds: dict[tuple, int] = {}

    def record(self, cls: int, rows: int, tokens: int, seconds: float, ar_seconds: float, column: int) -> None:
        """One drafting round of `rows` requests of class `cls` at the policy's window column:
        `tokens` emitted in `seconds`."""
        if seconds <= 0 or ar_seconds <= 0 or tokens <= 0:
            return
        x = math.log((tokens / seconds) / (rows / ar_seconds))
        for key in ((cls,), (cls, bucket(rows)), (cls, bucket(rows), column)):
            n = self.rounds.get(key, 0)
            old = self.log_ratio.get(key, x)
            self.log_ratio[key] = x if n == 0 else old + max(RATE, 1.0 / (n + 1)) * (x - old)
            self.rounds[key] = n + 1

    def drafting_loses(self, cls: int, rows: int) -> bool:
        """True where this batch size's drafting rounds have, on average over LOSE_ROUNDS or more,
        lost to AR by MARGIN: the forecasts are overruled there too (only their probes still draft,
        and those keep the average current). It takes more rounds than keeping drafting does: a
        few cold rounds at a request's start must not lock a class out that pays on average."""
        key = (cls, bucket(rows))
        return self.rounds.get(key, 0) >= LOSE_ROUNDS and self.log_ratio[key] < -math.log(MARGIN)

    def column(self, cls: int, rows: int, chosen: int, columns: int) -> int:
        """The window column to draft at: the forecast's choice, unless another column has
        measurably done better for this kind of batch (each judged on MIN_ROUNDS rounds or more,
        the other by SIZE_MARGIN). Columns the forecast picks but nobody measured yet are kept,
        so the forecast's picks are what explores."""
        b = bucket(rows)
        if self.rounds.get((cls, b, chosen), 0) < MIN_ROUNDS:
            return chosen
        seen = [c for c in range(columns) if self.rounds.get((cls, b, c), 0) >= MIN_ROUNDS]
        best = max(seen, key=lambda c: self.log_ratio[(cls, b, c)])
        if self.log_ratio[(cls, b, best)] > self.log_ratio[(cls, b, chosen)] + math.log(SIZE_MARGIN):
            return best
        return chosen

    def keep_drafting(self, cls: int, rows: int) -> bool:
        """True while the class has had fewer than MIN_ROUNDS drafting rounds (nothing is known
        yet: a few drafting rounds cost little once per process and class, and the forecasts start
        from real evidence), and where this batch size's drafting rounds (MIN_ROUNDS or more) beat
        AR by MARGIN on average. Elsewhere the forecasts decide alone."""
        if self.rounds.get((cls,), 0) < MIN_ROUNDS:
            return True
        key = (cls, bucket(rows))
        return self.rounds.get(key, 0) >= MIN_ROUNDS and self.log_ratio[key] >= math.log(MARGIN)

    def ratio(self, cls: int, rows: int) -> float | None:
        """The average realized ratio for this kind of batch, None before any drafting round."""
        key = (cls, bucket(rows))
        return math.exp(self.log_ratio[key]) if key in self.log_ratio else None
