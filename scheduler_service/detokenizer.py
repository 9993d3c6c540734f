"""Incremental detokenization with stop strings, one instance per request.

Text is released only when it is final: never a broken UTF-8 tail (tokenizers' DecodeStream,
`Tokenizer.decode_stream`, holds a window ending in U+FFFD until the next token: vLLM's
prefix_offset / read_offset technique; it gives the text the hand-written version of it gave,
token for token), and never characters that may still turn out to begin a stop string (the
library has no stop strings: that hold-back is ours). At the end, flush() releases what is held,
a broken tail included as U+FFFD, as decode() of all the tokens would (DecodeStream has no flush).

The generated text is decoded after the prompt's last tokens (`prompt_context`), as the text that
continues the prompt: a SentencePiece-style decoder (Llama 2's, Mistral's) drops the space that
begins a text, so the first generated word decoded alone lost its own (" Paris" came out "Paris").

`skip_special_tokens` (the request's) is passed to every decode of a request, the prompt's context
included: a special token's text counted in one and not the other would shift the cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_service.tokenizer import Tokenizer

# The prompt tokens a request's text is decoded after: at least a few (a word's), and at most
# this many to find a suffix that begins on a character (byte-level tokens may split one).
MIN_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS = 4, 24


def prompt_context(
    tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
) -> list[int]:
    """The prompt's last tokens that its generated text is decoded after: a suffix whose text is
    whole characters (none when the prompt ends inside one: its text is then decoded alone)."""
    num = len(prompt_token_ids)
    for n in range(min(MIN_CONTEXT_TOKENS, num), min(MAX_CONTEXT_TOKENS, num) + 1):
        context = list(prompt_token_ids[num - n :])
        if "\ufffd" not in tokenizer.decode(context, skip_special_tokens):
            return context
    return []


def decode_after(
    tokenizer: Tokenizer, context: Sequence[int], token_ids: Sequence[int], skip_special_tokens: bool = True
) -> str:
    """The text of token_ids following the tokens of `context` (prompt_context)."""
    if not context:
        return tokenizer.decode(list(token_ids), skip_special_tokens)
    whole = tokenizer.decode([*context, *token_ids], skip_special_tokens)
    return whole[len(tokenizer.decode(list(context), skip_special_tokens)) :]


@dataclass(slots=True)
class DetokenizerUpdate:
    text: str
    # How many of the tokens passed to add() belong to the output (all of them unless a
    # stop string ended the request inside the batch).
    num_tokens: int
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Feed generated token ids with add(); call flush() when the request finishes.
    `include_stop`: the output keeps the stop string that ends it; `min_tokens`: stop strings
    count only in text that tokens after the first min_tokens complete (vLLM's rule); `context`: the
    prompt tokens the text follows (prompt_context, with the same `skip_special_tokens`);
    `skip_special_tokens` off: special tokens are written in the text (and stop strings may match
    them)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
        context: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.skip_special_tokens = skip_special_tokens
        self._step = tokenizer.decode_stream(skip_special_tokens)
        self._context = list(context)
        for tok in self._context:  # (whole characters: their text comes out, and is not ours)
            self._step(tok)
        # Characters of text the stream has produced (released or held).
        self._num_chars = 0
        # Decoded text not yet released: a possible start of a stop string.
        self._held = ""
        # How many of _held's first characters the first min_tokens tokens completed: a stop string
        # must end past them (one may begin in them, and is then held back like any other).
        self._before_min = 0
        self.stopped: str | None = None

    def add(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        if self.stopped is not None:
            return DetokenizerUpdate("", 0, self.stopped)
        step = self._step
        if not self.stop:
            self.token_ids.extend(token_ids)
            text = "".join([t for t in map(step, token_ids) if t])
            self._num_chars += len(text)
            return DetokenizerUpdate(text, len(token_ids))
        # Token by token: a stop string ends the output at the token that completed it.
        out = []
        for i, tok in enumerate(token_ids):
            self.token_ids.append(tok)
            text = step(tok)
            if text:
                self._num_chars += len(text)
                self._held += text
            if len(self.token_ids) <= self.min_tokens:
                # No stop string yet, but a possible start of one is still held back: a token past
                # min_tokens may complete it.
                self._before_min = len(self._held)
                self._release(out)
                continue
            hit = self._find_stop()
            if hit is not None:
                index, stop = hit
                out.append(self._held[: index + len(stop) if self.include_stop else index])
                self._held = ""
                self.stopped = stop
                return DetokenizerUpdate("".join(out), i + 1, stop)
            self._release(out)
        return DetokenizerUpdate("".join(out), len(token_ids))

    def _release(self, out: list[str]) -> None:
        """Move the held text that cannot begin a stop string to `out`."""
        release = len(self._held) - self._held_back_length()
        if release > 0:
            out.append(self._held[:release])
            self._held = self._held[release:]
            self._before_min = max(0, self._before_min - release)

    def flush(self) -> str:
        """Everything still held back, once the request has finished without a stop string."""
        if self.stopped is not None:
            return ""
        tail = decode_after(self.tokenizer, self._context, self.token_ids, self.skip_special_tokens)
        tail = tail[self._num_chars :]
        self._num_chars += len(tail)
        text = self._held + tail
        self._held = ""
        return text

    def _find_stop(self) -> tuple[int, str] | None:
        best = None
        for stop in self.stop:
            index = self._held.find(stop, max(0, self._before_min - len(stop) + 1))
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
