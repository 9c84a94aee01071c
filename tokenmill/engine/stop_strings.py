"""Stop-string matching in O(new text): an Aho-Corasick automaton over a request's stop strings.

Searching every stop string in every new piece of text costs O(stops x text) per step; the automaton reads
each new character once, whatever the number of stops. Its state is also the longest end of the text that
could still grow into a stop string: exactly what a stream must hold back.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._end = [-1]  # per node: the stop string ending here (the longest, via suffix links), or -1
        for i, stop in enumerate(stops):
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = self._goto[node][ch] = len(self._goto)
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._end.append(-1)
                node = nxt
            if self._end[node] == -1:  # the same string listed twice: the first one names it
                self._end[node] = i
        self._fail = [0] * len(self._goto)
        order = list(self._goto[0].values())
        for node in order:  # breadth first: a node's suffix link is set before its children's
            for ch, child in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                link = self._goto[f].get(ch, 0) if node else 0
                self._fail[child] = link if link != child else 0
                if self._end[child] == -1:
                    self._end[child] = self._end[self._fail[child]]
                order.append(child)
        self.state = 0

    @property
    def partial(self) -> int:
        """How many trailing characters of the text read so far begin (or are) a stop string."""
        return self._depth[self.state]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Read `text`; the first stop string that ends in it, as (its start offset within `text`, possibly
        negative when it began in earlier text, the stop string), or None. Of stop strings ending at the
        same character the longest wins. The state moves past the whole text either way."""
        goto, fail, end = self._goto, self._fail, self._end
        state, found = self.state, None
        for pos, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if found is None and end[state] != -1:
                stop = self.stops[end[state]]
                found = (pos + 1 - len(stop), stop)
        self.state = state
        return found
