"""Stop strings, checked on the accumulated output text.

A stop string may span several tokens, so the check runs on the text, not on
single token texts. While streaming, text that could still turn out to be the
beginning of a stop string is held back: a client never receives part of a
stop string. The output ends right before the stop string (or right after it
with include_stop_str_in_output).

Only the unreleased text is kept: a match cannot begin in released text
(that part was released only because it could not begin one), so each call
costs the held-back length, not the whole output's.
"""
from __future__ import annotations


class StopChecker:
    def __init__(self, stop: list[str] | tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._pending = ""  # decoded but not yet released
        self.matched: str | None = None

    def feed(self, new_text: str, check: bool = True) -> str:
        """Add newly decoded text; return the text that may be released now.

        After a match, `matched` names the stop string and further calls
        return "" (the request is finished). With `check` false no match may
        end in `new_text` (vLLM's min_tokens: the first tokens' text cannot stop
        the output), though one may begin there and end in later text.
        """
        if self.matched is not None or not new_text:
            return ""
        previous_len = len(self._pending)
        self._pending += new_text
        if not self.stop:
            return self._release(len(self._pending))
        if not check:
            return self._release(len(self._pending) - self._held_back_len())
        match = self._find_stop(previous_len)
        if match is not None:
            start, stop = match
            self.matched = stop
            released = self._release(start + (len(stop) if self.include_stop_str_in_output else 0))
            self._pending = ""
            return released
        return self._release(len(self._pending) - self._held_back_len())

    def flush(self) -> str:
        """Release everything held back (the request finished for another reason)."""
        return self._release(len(self._pending))

    def _find_stop(self, previous_len: int) -> tuple[int, str] | None:
        """The match that ends first (then: starts first) among those ending
        in the new text; older ones were found by earlier calls. Ending first
        is where token-by-token generation would have stopped, so the result
        does not depend on how the text was chunked."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            start = self._pending.find(stop, max(0, previous_len - len(stop) + 1))
            if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        text = self._pending
        longest = 0
        for stop in self.stop:
            # Such a suffix starts with stop[0]: only try where that character occurs
            # (earliest first, i.e. longest first), not every length.
            start = text.find(stop[0], max(len(text) - len(stop) + 1, 0))
            while start != -1 and len(text) - start > longest:
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break
                start = text.find(stop[0], start + 1)
        return longest

    def _release(self, upto: int) -> str:
        released, self._pending = self._pending[:upto], self._pending[upto:]
        return released
