"""Text out of generated token ids: incremental detokenizing and stop strings.

- text delta: the new text one generated token adds. Byte-level tokenizers can split a
  UTF-8 character over several tokens; while the decoded tail is an incomplete character
  (U+FFFD) nothing is emitted, so a client never sees a replacement character that later
  turns into a real one.
- stop string: text that ends the generation (OpenAI's `stop`). It is not part of the
  output; text that might be the start of a stop string is held back until it is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Feed generated ids one by one with push(); each call returns the text to emit."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already handed out
        self.stopped = False  # a stop string was found; push() emits nothing more
        self._text = ""

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        self._text = self.decode(self.ids)
        if self._text.endswith(REPLACEMENT):
            return ""
        found = [i for i in (self._text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            self._text = self._text[: min(found)]
            return self._take(len(self._text))
        return self._take(len(self._text) - self._held_back())

    def finish(self) -> str:
        """The held-back rest, once generation is over."""
        return self._take(len(self._text))

    @property
    def text(self) -> str:
        """The whole output so far (without any stop string)."""
        return self._text

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _take(self, end: int) -> str:
        end = max(end, self.emitted)
        out = self._text[self.emitted : end]
        self.emitted = end
        return out
