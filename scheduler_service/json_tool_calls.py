"""Tool calls written as a run of JSON objects, `{"name": ..., "arguments": {...}}`, with a separator
between them: Llama 3's JSON calls (`;`, llama_tool_calls.py) and the array Mistral's models wrote
before its v11 tokenizer (`,` up to `]`, mistral_tool_calls.py).

A call streams as the Hermes parser's do (tool_calls.py): its index, id and name once its object
reads `{"name": "...", "arguments": ` (or Llama's "parameters") and the arguments' opening bracket,
then the model's own text of the arguments up to the bracket that closes them; the rest of the
object is dropped. An object of another shape is parsed when it closes (one delta for the call).
The run ends at its end mark, or at the first thing that is neither a separator nor an object after
one; what follows is no part of the answer (as in vLLM's parsers). An object that is no call (not
JSON, no name) before any call fails the run: the parser that owns it sends its text as content."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from scheduler_service.sampling_params import escape_surrogates
from scheduler_service.tool_calls import ToolCall, ToolCallDelta, _Brackets, parse_tool_call

# The start of a call whose arguments can stream: `{"name": "<name>", "arguments": ` and the
# arguments' own bracket (a string or a number is parsed when the object closes).
_HEADER = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[\[{])'
)


class JsonCallRun:
    """Feed the text after a format's start mark to add(), then finish(); each appends the call
    deltas to `deltas`. `state` is "between" (before an object, or after one), "object", "done"
    (the run has ended: the rest is dropped) or "failed" (its first object was no call)."""

    def __init__(
        self,
        separator: str,
        end: str | None,
        new_id: Callable[[], str],
        needs_arguments: bool,
    ) -> None:
        self._separator, self._end = separator, end
        self._new_id = new_id
        # Llama's: an object without "arguments" or "parameters" is no call (a JSON answer).
        self._needs_arguments = needs_arguments
        self.state = "between"
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet read
        self._expects_object = True  # at the start, or after a separator
        self._body = ""  # an object's text while its header is not yet read
        self._object = _Brackets()  # where the object ends
        self._arguments: _Brackets | None = None  # where the arguments end, once the header is read
        self._arguments_done = False

    def add(self, text: str, deltas: list[ToolCallDelta]) -> None:
        self._pending += text
        while self._pending and self.state in ("between", "object"):
            if self.state == "between":
                self._between()
                continue
            end = self._object.close(self._pending)
            if end is None:
                piece, self._pending = self._pending, ""
            else:
                piece, self._pending = self._pending[:end], self._pending[end:]
            self._in_object(piece, end is not None, deltas)
            if end is not None and self.state == "object":
                self.state, self._expects_object = "between", False
        if self.state in ("done", "failed"):
            self._pending = ""

    def finish(self, deltas: list[ToolCallDelta]) -> None:
        """The answer has ended: an object cut short is a call if its header was read."""
        if self.state == "object" and self._arguments is None:
            self._in_object("", True, deltas)
        elif self.state == "between" and not self.calls:
            self.state = "failed"
        if self.state != "failed":
            self.state = "done"

    def _between(self) -> None:
        stripped = self._pending.lstrip()
        if not stripped:
            self._pending = ""
            return
        first = stripped[0]
        if first == "{" and self._expects_object:
            self._pending, self.state = stripped, "object"
            self._body, self._object, self._arguments, self._arguments_done = "", _Brackets(), None, False
        elif first == self._separator and not self._expects_object:
            self._pending, self._expects_object = stripped[1:], True
        else:  # the end mark, or anything else: the run is over
            self.state = (
                "done" if self.calls or (first == self._end and not self._expects_object) else "failed"
            )

    def _in_object(self, piece: str, closed: bool, deltas: list[ToolCallDelta]) -> None:
        """Text of the current object (all of it when `closed`)."""
        if self._arguments is None:
            self._body += piece
            match = _HEADER.match(self._body)
            if match is None:
                if closed:
                    self._whole_object(deltas)
                return
            call = ToolCall(len(self.calls), self._new_id(), _name(match.group(1)), "")
            self.calls.append(call)
            deltas.append(ToolCallDelta(call.index, call.id, call.name, ""))
            self._arguments = _Brackets()
            piece, self._body = self._body[match.end() :], ""
        if self._arguments_done:
            return
        end = self._arguments.close(piece)
        if end is not None:
            piece, self._arguments_done = piece[:end], True
        if piece:
            call = self.calls[-1]
            call.arguments += piece
            deltas.append(ToolCallDelta(call.index, arguments=piece))

    def _whole_object(self, deltas: list[ToolCallDelta]) -> None:
        """An object of another shape: a call if it parses, else the run is over."""
        call = self._call_of(self._body)
        self._body = ""
        if call is None:
            self.state = "done" if self.calls else "failed"
            return
        self.calls.append(call)
        deltas.append(ToolCallDelta(call.index, call.id, call.name, call.arguments))

    def _call_of(self, text: str) -> ToolCall | None:
        if self._needs_arguments:
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):  # (as parse_tool_call)
                return None
            if not isinstance(value, dict) or ("arguments" not in value and "parameters" not in value):
                return None
        call = parse_tool_call(text, len(self.calls))
        if call is not None:
            call.id = self._new_id()
        return call


def _name(quoted: str) -> str:
    """A name as the header reads it (the text between its quotes), decoded."""
    try:
        return escape_surrogates(json.loads(f'"{quoted}"'))
    except ValueError:
        return quoted
