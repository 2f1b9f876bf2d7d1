"""Stop strings (the ``x-stop`` extension): answer text is cut before the first one.

Text that could be the beginning of a stop string is held back until the next text decides, so
no event ever carries part of a stop string; what is held when generation ends otherwise is
released. Depends only on the text fed, so a resumed task reaches the same state.
"""

from collections.abc import Sequence

from workers.output.reasoning import partial_suffix


class StopFilter:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.hit = False  # a stop string appeared: everything after it is dropped

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what was held) that can be emitted now."""
        if self.hit or not self._stops:
            return "" if self.hit else text
        buffer = self._held + text
        found = [index for stop in self._stops if (index := buffer.find(stop)) >= 0]
        if found:
            self.hit, self._held = True, ""
            return buffer[:min(found)]
        keep = partial_suffix(buffer, self._stops)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """What is held, when generation ends without a stop string."""
        held, self._held = self._held, ""
        return held
