"""Tool calls in the Hermes format that Qwen3's chat template asks for, as vLLM's hermes parser:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become OpenAI `tool_calls`; the
text before the first one is the content, text after it is dropped.

A call streams as OpenAI's deltas do: its index, id and function name once the block's text reads
`{"name": "...", "arguments":`, then fragments of the arguments as the model writes them: an object
or array up to the bracket that closes it (what the model writes after it, such as another key or a
stray brace, is no part of the arguments, as in vLLM's parser), any other value up to the brace that
closes the block's object. A call's `arguments` is the concatenation of its fragments: the model's
own JSON text, so that whole and streamed answers agree whatever the pieces. A block of another
shape is parsed when it closes (one delta for the call), and one that is not a call (not JSON, no
name) stays in the content as written."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from scheduler_service.reasoning import held_back
from scheduler_service.sampling_params import escape_surrogates

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# The start of a call whose arguments can stream: `{"name": "<name>", "arguments": `.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
# What may still turn out to be the end of the call's object: spaces and its closing brace.
_CLOSING = re.compile(r"\s*\}?\s*$")


@dataclass(slots=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call `index`: its id and name (the call's first delta), and arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    """An id in vLLM's style for Hermes and Llama calls: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def parse_tool_call(body: str, index: int) -> ToolCall | None:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, an integer past Python's 4,300 digits, nested too deep
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    # (Llama 3's name for them, which some Hermes-style fine-tunes write)
    arguments = call["arguments"] if "arguments" in call else call.get("parameters", {})
    return ToolCall(
        index=index,
        id=new_call_id(),
        name=escape_surrogates(call["name"]),
        arguments=escape_surrogates(
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        ),
    )


class ToolCallParser:
    """Feed content deltas to add(), then finish(); each returns (content delta, tool call
    deltas). `calls` holds the calls so far, whole."""

    def __init__(self) -> None:
        self._buffer = ""
        # "text" (outside a block), "header" (in a block, before its arguments), "arguments"
        # (streaming a scalar), "nested" (streaming an object or array), "string" (arguments given
        # as a JSON string: decoded at the end), "after" (the arguments are whole: the rest of the
        # block is dropped).
        self._state = "text"
        self._body = ""  # a block's text while its header is not yet read
        self._held = ""  # arguments text not yet sent: it may close the object
        self._started = False  # whether the arguments' first character has come
        self._brackets = _Brackets()
        self.calls: list[ToolCall] = []

    def add(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        content, deltas = "", []
        while True:
            if self._state == "text":
                start = self._buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = held_back(self._buffer, TOOL_CALL_START)
                    text, self._buffer = (
                        self._buffer[: len(self._buffer) - keep],
                        self._buffer[len(self._buffer) - keep :],
                    )
                    if not self.calls:
                        content += text
                    return content, deltas
                if not self.calls:
                    content += self._buffer[:start]
                self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
                self._state, self._body = "header", ""
                continue
            end = self._buffer.find(TOOL_CALL_END)
            closed = end >= 0
            if closed:
                piece, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_END) :]
            else:
                keep = held_back(self._buffer, TOOL_CALL_END)
                piece, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
            content += self._in_block(piece, closed, deltas)
            if not closed:
                return content, deltas
            self._state = "text"

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest: an unclosed block ends with the answer."""
        if self._state == "text":
            rest, self._buffer = self._buffer, ""
            return ("" if self.calls else rest), []
        piece, self._buffer = self._buffer, ""
        deltas: list[ToolCallDelta] = []
        content = self._in_block(piece, True, deltas, unclosed=True)
        self._state = "text"
        return content, deltas

    def _in_block(self, piece: str, closed: bool, deltas: list[ToolCallDelta], unclosed: bool = False) -> str:
        """Text of a block (all of it when `closed`); returns what goes to the content."""
        if self._state == "header":
            self._body += piece
            match = _HEADER.match(self._body)
            if match is None:
                if not closed:
                    return ""
                return self._whole_block(self._body, deltas, unclosed)
            try:
                name = escape_surrogates(json.loads(f'"{match.group(1)}"'))
            except ValueError:
                name = match.group(1)
            call = ToolCall(len(self.calls), new_call_id(), name, "")
            self.calls.append(call)
            deltas.append(ToolCallDelta(call.index, call.id, name, ""))
            self._state, self._held, self._started = "arguments", "", False
            piece, self._body = self._body[match.end() :], ""
        self._arguments(piece, closed, deltas)
        return ""

    def _arguments(self, piece: str, closed: bool, deltas: list[ToolCallDelta]) -> None:
        held = self._held + piece
        if not self._started:
            held = held.lstrip()
            if not held:
                self._held = ""
                return
            self._started = True
            if held.startswith('"'):
                self._state = "string"
            elif held[0] in "{[":
                self._state, self._brackets = "nested", _Brackets()
        if self._state == "after":
            self._held = ""
            return
        if self._state == "nested":
            end = self._brackets.close(held)
            self._held = ""
            if end is not None:
                held, self._state = held[:end], "after"
            self._send(held, deltas)
            return
        if self._state == "string":  # a JSON string: its value is the arguments, sent at the end
            self._held = held
            if closed:
                out = held.rstrip().removesuffix("}").rstrip()
                try:
                    value = json.loads(out)
                except (ValueError, RecursionError):  # as parse_tool_call
                    value = out
                self._send(escape_surrogates(value) if isinstance(value, str) else out, deltas)
            return
        if closed:
            out = held.rstrip()
            out, self._held = (out[:-1].rstrip() if out.endswith("}") else out), ""
        else:
            cut = _CLOSING.search(held).start()
            out, self._held = held[:cut], held[cut:]
        self._send(out, deltas)

    def _send(self, arguments: str, deltas: list[ToolCallDelta]) -> None:
        if arguments:
            call = self.calls[-1]
            call.arguments += arguments
            deltas.append(ToolCallDelta(call.index, arguments=arguments))

    def _whole_block(self, body: str, deltas: list[ToolCallDelta], unclosed: bool) -> str:
        """A closed block of another shape: a call if it parses, else the content as written."""
        call = parse_tool_call(body.strip(), len(self.calls))
        if call is None:
            if self.calls:
                return ""
            return TOOL_CALL_START + body + ("" if unclosed else TOOL_CALL_END)
        self.calls.append(call)
        deltas.append(ToolCallDelta(call.index, call.id, call.name, call.arguments))
        return ""


class _Brackets:
    """Where a JSON object or array written in pieces ends: its brackets' depth, outside strings."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def close(self, text: str) -> int | None:
        """The end (exclusive) in `text` of the bracket that closes the value, else None (more
        to come)."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None
