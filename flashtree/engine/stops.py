"""Stop strings found incrementally: an Aho–Corasick automaton over a request's stops, fed
each round's new text once.

Rescanning the text (or every prefix of every stop) each round costs O(text x stops) per
round; the automaton costs O(new text) per round, amortized, plus O(stops) to build once
per request. Its state also says how many trailing characters could still grow into a stop
string (the node's depth), which is exactly what a stream must hold back.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class StopHit(NamedTuple):
    """A stop string found at text[start:end] (positions in all the text fed so far)."""

    start: int
    end: int


class StopStrings:
    """The automaton of one request's stop strings, shared by its samples.

    Pickles as the strings alone (tensor-parallel workers receive requests but never match
    stops), and builds its tables on first use."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._tables: tuple[list[dict[str, int]], list[int], list[int], list[int]] | None = None

    def __getstate__(self) -> dict:
        return {"stops": self.stops}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["stops"])

    @property
    def tables(self) -> tuple[list[dict[str, int]], list[int], list[int], list[int]]:
        """(goto, fail, depth, match) per trie node; match is the length of the longest stop
        string that ends at the node (0: none), through its failure links."""
        if self._tables is None:
            self._tables = _build(self.stops)
        return self._tables


def _build(stops: list[str]) -> tuple[list[dict[str, int]], list[int], list[int], list[int]]:
    goto: list[dict[str, int]] = [{}]
    depth, match = [0], [0]
    for s in stops:
        node = 0
        for ch in s:
            nxt = goto[node].get(ch)
            if nxt is None:
                nxt = len(goto)
                goto.append({})
                depth.append(depth[node] + 1)
                match.append(0)
                goto[node][ch] = nxt
            node = nxt
        match[node] = len(s)
    fail = [0] * len(goto)
    queue = deque(goto[0].values())  # depth 1 fails to the root
    while queue:  # breadth first, so a node's failure target is final before its children's
        node = queue.popleft()
        for ch, child in goto[node].items():
            f = fail[node]
            while f and ch not in goto[f]:
                f = fail[f]
            fail[child] = goto[f].get(ch, 0)
            match[child] = match[child] or match[fail[child]]
            queue.append(child)
    return goto, fail, depth, match


class StopMatcher:
    """One sample's position in the automaton: fed its committed text, piece by piece.

    `scanned` counts the steps taken (characters read plus failure links followed), which is
    at most twice the characters fed plus the longest stop's length."""

    def __init__(self, strings: StopStrings) -> None:
        self.strings = strings
        self.node = 0
        self.fed = 0  # characters fed (committed) so far
        self.scanned = 0

    @property
    def held(self) -> int:
        """Trailing characters of the fed text that could still start a stop string."""
        return self.strings.tables[2][self.node]

    def feed(self, text: str, commit: bool = True) -> StopHit | None:
        """Read `text`; the first stop string that ends inside it (the longest of those ending
        at the same character), or None. With commit=False the state is left as it was (text
        that a later round may still change, such as half a UTF-8 character)."""
        goto, fail, _, match = self.strings.tables
        node, steps = self.node, 0
        hit = None
        for i, ch in enumerate(text):
            while True:
                steps += 1
                nxt = goto[node].get(ch)
                if nxt is not None:
                    node = nxt
                    break
                if node == 0:
                    break
                node = fail[node]
            if match[node]:
                end = self.fed + i + 1
                hit = StopHit(end - match[node], end)
                break
        self.scanned += steps
        if commit:
            self.node = node
            self.fed += len(text) if hit is None else hit.end - self.fed
        return hit
