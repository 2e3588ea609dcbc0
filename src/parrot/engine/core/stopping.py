"""Stop-string handling for streamed text.

:class:`StopStringFilter` receives text deltas and releases text that can no
longer turn out to be the start of a stop string.  Invariant: the
concatenation of everything released equals the generated text truncated
just before the first occurrence of any stop string (or the whole text if
none occurs), and released text is never retracted.
"""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """Feed a delta; returns text safe to release.  Sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return ""
        self._pending += delta
        if not self.stop:
            out, self._pending = self._pending, ""
            return out
        cut = min((i for i in (self._pending.find(s) for s in self.stop) if i != -1), default=-1)
        if cut != -1:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = min(self._hold, len(self._pending))
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return out

    def flush(self) -> str:
        """Release whatever is held back (generation ended without a stop string)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
