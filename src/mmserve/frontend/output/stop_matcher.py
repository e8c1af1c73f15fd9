"""Stop strings matched incrementally: an Aho-Corasick automaton over one request's stop strings.

Each character of new output text advances the automaton by amortised O(1) steps whatever the
number of stop strings, and the automaton's state is also the longest tail of the text that could
still grow into a stop string (what a stream holds back). Automata are shared between requests
with the same stop strings (`StopAutomaton.of`, bounded LRU).
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopAutomaton:
    """The trie of `stops` with failure links; node 0 is the root."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.children: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.fail = [0]
        self.match = [0]  # the longest stop string that is a suffix of the node's text (0: none)
        for stop in stops:
            self._insert(stop)
        self._link()

    @staticmethod
    @lru_cache(maxsize=64)
    def of(stops: tuple[str, ...]) -> StopAutomaton:
        """The (shared, immutable) automaton of `stops`."""
        return StopAutomaton(stops)

    def _insert(self, stop: str) -> None:
        node = 0
        for ch in stop:
            nxt = self.children[node].get(ch)
            if nxt is None:
                nxt = len(self.children)
                self.children[node][ch] = nxt
                self.children.append({})
                self.depth.append(self.depth[node] + 1)
                self.fail.append(0)
                self.match.append(0)
            node = nxt
        self.match[node] = len(stop)

    def _link(self) -> None:
        """Failure links breadth first; `match` inherits the failure target's when it has none."""
        queue = deque(self.children[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self.children[node].items():
                target = self.fail[node]
                while target and ch not in self.children[target]:
                    target = self.fail[target]
                link = self.children[target].get(ch, 0)
                self.fail[child] = link if link != child else 0
                self.match[child] = self.match[child] or self.match[self.fail[child]]
                queue.append(child)

    def step(self, node: int, ch: str) -> int:
        """The state after reading `ch` in state `node`."""
        while node and ch not in self.children[node]:
            node = self.fail[node]
        return self.children[node].get(ch, 0)


class StopMatcher:
    """One output's position in its stop strings' automaton."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.automaton = StopAutomaton.of(stops)
        self.state = 0

    def feed(self, text: str, offset: int, report: bool) -> tuple[int, int] | None:
        """Read `text`, which starts at `offset` of the output; with `report`, the (start, end) of
        the match that starts first (then ends first) among the stop strings ending in `text`."""
        automaton, best = self.automaton, None
        for i, ch in enumerate(text):
            self.state = automaton.step(self.state, ch)
            length = automaton.match[self.state]
            if report and length:
                end = offset + i + 1
                if best is None or end - length < best[0]:
                    best = (end - length, end)
        return best

    @property
    def pending(self) -> int:
        """Characters at the text's end that could still begin a stop string."""
        return self.automaton.depth[self.state]
