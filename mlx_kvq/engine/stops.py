"""Stop strings matched on decoded text, not on token ids.

Matching on text finds a stop string however the model happened to tokenize
it, and holding back any tail that could still become a stop string means a
streaming client never sees part of one.
"""

from __future__ import annotations


class StopMatcher:
    """Feed decoded text; get back what is safe to show and whether a stop hit."""

    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        """Returns (text to emit, stopped). After a stop, the rest is dropped."""
        buf = self._held + text
        self._held = ""
        cut = first_stop(buf, self.stops)
        if cut is not None:
            return buf[:cut], True
        if final or not self.stops:
            return buf, False
        keep = self._partial_tail(buf)
        if keep:
            self._held = buf[-keep:]
            buf = buf[:-keep]
        return buf, False

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that starts some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if stop.startswith(buf[-k:]):
                    longest = k
                    break
        return longest


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where `text` is cut by the stop string that completes first, or None.

    Generation stops as soon as any stop string is complete, so the match
    that ends earliest wins (the longest one, among those ending together).
    """
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), i)
            if best is None or key < best:
                best = key
    return None if best is None else best[1]
