"""Incremental detokenization with stop strings, one instance per request.

Text is released only when it is final: never a broken UTF-8 tail (a decoded window ending
in U+FFFD waits for the next token: vLLM's prefix_offset / read_offset technique), and never
characters that may still turn out to begin a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_service.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class DetokenizerUpdate:
    text: str
    # How many of the tokens passed to add() belong to the output (all of them unless a
    # stop string ended the request inside the batch).
    num_tokens: int
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Feed generated token ids with add(); call flush() when the request finishes."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # Decoded text not yet released: a possible start of a stop string.
        self._held = ""
        self.stopped: str | None = None

    def add(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        if self.stopped is not None:
            return DetokenizerUpdate("", 0, self.stopped)
        if not self.stop:
            self.token_ids.extend(token_ids)
            text = self._decode_tail()
            if text or len(token_ids) <= 1:
                return DetokenizerUpdate(text, len(token_ids))
            # The batch ends inside a character: release what precedes it, token by token.
            del self.token_ids[-len(token_ids) :]
        # Token by token: a stop string ends the output at the token that completed it.
        out = []
        for i, tok in enumerate(token_ids):
            self.token_ids.append(tok)
            self._held += self._decode_tail()
            hit = self._find_stop()
            if hit is not None:
                index, stop = hit
                out.append(self._held[:index])
                self._held = ""
                self.stopped = stop
                return DetokenizerUpdate("".join(out), i + 1, stop)
            release = len(self._held) - self._held_back_length()
            if release > 0:
                out.append(self._held[:release])
                self._held = self._held[release:]
        return DetokenizerUpdate("".join(out), len(token_ids))

    def flush(self) -> str:
        """Everything still held back, once the request has finished without a stop string."""
        if self.stopped is not None:
            return ""
        text = self._held + self._decode(self._prefix_offset)[len(self._decode_prefix()) :]
        self._held = ""
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return text

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)

    def _decode_prefix(self) -> str:
        return self._decode(self._prefix_offset, self._read_offset)

    def _decode_tail(self) -> str:
        """New complete text since the last read; advances the offsets when there is some."""
        prefix_text = self._decode_prefix()
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _find_stop(self) -> tuple[int, str] | None:
        best = None
        for stop in self.stop:
            index = self._held.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_back_length(self) -> int:
        """The longest suffix of the held text that is a proper prefix of a stop string."""
        held = self._held
        for k in range(min(len(held), self._max_stop - 1), 0, -1):
            tail = held[-k:]
            if any(stop.startswith(tail) for stop in self.stop):
                return k
        return 0
