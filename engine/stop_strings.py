"""Stop strings found in a request's text as it grows, in time linear in the text: one Knuth-Morris-Pratt automaton
per stop string, fed each new character once. Each automaton's state is the length of the longest start of its
string that ends the text so far, which is also how much text a stream must hold back (it may yet become a stop)."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self._fallback = [_fallback(stop) for stop in stops]
        self._matched = [0] * len(stops)  # per stop string: how much of its start ends the text so far

    def feed(self, text: str) -> int | None:
        """Take the text's next characters. When a stop string now ends inside them: where the first one to end
        begins (the longest, if several end there), as an offset into `text` (negative when it began in earlier
        text); else None."""
        for end, char in enumerate(text, 1):
            begins = None
            for i, stop in enumerate(self.stops):
                k, fallback = self._matched[i], self._fallback[i]
                while k and stop[k] != char:
                    k = fallback[k - 1]
                k += stop[k] == char
                if k == len(stop):  # of two ending here, the longer begins first and is cut whole
                    begins = min(end - k, begins if begins is not None else end)
                self._matched[i] = k
            if begins is not None:
                return begins
        return None

    @property
    def held_back(self) -> int:
        """Characters at the text's end that may still start a stop string."""
        return max(self._matched, default=0)


def _fallback(stop: str) -> list[int]:
    """KMP's failure function: for each prefix of `stop`, the length of its longest proper prefix that is also its
    suffix."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        k += stop[i] == stop[k]
        table[i] = k
    return table
