"""Tool calls in the Hermes format that Qwen3's chat template asks for, as vLLM's hermes parser:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become OpenAI `tool_calls`; the
text before the first one is the content, text after it is dropped. A block that is not valid JSON
stays in the content as written. Streamed and whole outputs go through the same parser: a call is
sent as one delta once its block is closed (or at the end, when it parses)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from scheduler_service.reasoning import held_back

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(slots=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON

    def to_openai(self, with_index: bool = False) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return {"index": self.index, **call} if with_index else call


def parse_tool_call(body: str, index: int) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return ToolCall(
        index=index,
        id=f"chatcmpl-tool-{uuid.uuid4().hex}",
        name=call["name"],
        arguments=arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
    )


class ToolCallParser:
    """Feed content deltas to add(), then finish(); each returns (content delta, new tool calls)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def add(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    return content, calls
                body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_END) :]
                self._in_call = False
                content += self._close(body, calls)
                continue
            start = self._buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = held_back(self._buffer, TOOL_CALL_START)
                text, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                if not self.calls:
                    content += text
                return content, calls
            if not self.calls:
                content += self._buffer[:start]
            self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
            self._in_call = True

    def _close(self, body: str, calls: list[ToolCall]) -> str:
        call = parse_tool_call(body.strip(), len(self.calls))
        if call is None:
            return "" if self.calls else TOOL_CALL_START + body + TOOL_CALL_END
        self.calls.append(call)
        calls.append(call)
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buffer = self._buffer, ""
        calls: list[ToolCall] = []
        if self._in_call:
            self._in_call = False
            content = self._close(rest, calls)
            if content:  # an unclosed block that does not parse: as written
                content = content[: -len(TOOL_CALL_END)]
            return content, calls
        return ("" if self.calls else rest), calls
