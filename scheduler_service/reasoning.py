"""Qwen3's reasoning split, as vLLM's qwen3 reasoning parser: the text of a `<think>...</think>`
block is `reasoning_content`, what follows is `content`. The block is open when the output starts
with `<think>`, or when the prompt ended with it (templates that open it for the model); without
either, everything is content. Streamed and whole outputs go through the same parser, so their
concatenated deltas equal the whole answer."""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Feed text deltas to add(), then finish(); each returns (reasoning delta, content delta)."""

    def __init__(self, prompt: str = "") -> None:
        self._mode = "reasoning" if prompt.rstrip().endswith(THINK_START) else "start"
        self._buffer = ""

    def add(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        if self._mode == "start":
            stripped = self._buffer.lstrip()
            if THINK_START.startswith(stripped) and len(stripped) < len(THINK_START):
                return "", ""  # could still become <think>
            if stripped.startswith(THINK_START):
                self._buffer = stripped[len(THINK_START) :]
                self._mode = "reasoning"
            else:
                self._mode = "content"
        if self._mode == "reasoning":
            end = self._buffer.find(THINK_END)
            if end < 0:
                keep = held_back(self._buffer, THINK_END)
                reasoning, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(THINK_END) :]
            self._mode = "content"
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning inside an unclosed block, else content."""
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._mode == "reasoning" else ("", rest)
