"""Stop strings over streamed text: text is released only once it cannot be the start of a stop string."""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Feed text pieces; get back the text safe to send and, once one appears, the stop string that ended it."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """The text that can be sent now; after a match, the text before it (and nothing more, ever)."""
        if self.matched is not None:
            return ""
        self.held += text
        hits = [(at, s) for s in self.stops if (at := self.held.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.held = self.held[:at], ""
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        """What was held back when the text ends without a match."""
        out, self.held = ("" if self.matched is not None else self.held), ""
        return out
