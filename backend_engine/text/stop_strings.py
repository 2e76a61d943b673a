"""Stop strings over a stream of text deltas, holding back text that might start one."""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Cuts a streamed text at the first stop string, which is itself left out.

    ``feed`` returns the text that is safe to emit: text that can no longer become part of a
    stop string. A tail that is a proper prefix of some stop string is held back until the next
    delta decides it; ``flush`` releases it when the request ends for another reason::

        stop=["</s>"]   feed("Hi <")  -> ("Hi ", False)    "<" held back
                        feed("/s> x") -> ("",    True)     stop hit, nothing after it emitted
    """

    def __init__(self, stop: Iterable[str]) -> None:
        self._stop = tuple(dict.fromkeys(stop))
        if any(not s for s in self._stop):
            raise ValueError("stop strings must be non-empty")
        self._max_held = max((len(s) - 1 for s in self._stop), default=0)
        self._held = ""
        self._is_stopped = False

    @property
    def is_stopped(self) -> bool:
        return self._is_stopped

    @property
    def held_text(self) -> str:
        """Text received but not yet emitted."""
        return self._held

    def _partial_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        for length in range(min(self._max_held, len(text)), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; return (text safe to emit now, whether a stop string was hit)."""
        if self._is_stopped:
            return "", True
        if not self._stop:
            return delta, False
        text = self._held + delta
        hits = [i for s in self._stop if (i := text.find(s)) >= 0]
        if hits:
            self._is_stopped = True
            self._held = ""
            return text[: min(hits)], True
        keep = self._partial_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release the held-back text (the stream ended without a stop string)."""
        held, self._held = self._held, ""
        return "" if self._is_stopped else held
