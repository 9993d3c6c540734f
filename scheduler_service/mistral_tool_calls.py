"""Tool calls in Mistral's format, as vLLM's mistral parser: the text before the first
`[TOOL_CALLS]` is the content; after it, the calls in either of the shapes Mistral's models write:

- a JSON array of calls, `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (models of
  tokenizers before v11: Mistral 7B Instruct v0.3, Nemo; json_tool_calls.py streams them), what
  follows the array dropped;
- `[TOOL_CALLS]name{...}` for each call (v11 and later, `[TOOL_CALLS]name[ARGS]{...}` from v13):
  the arguments are the model's text of the object after the name, up to the brace that closes it.

vLLM picks the shape from the tokenizer's vocabulary ([ARGS] in it: v11); here the text tells, as
only an array begins with `[`. `[TOOL_CALLS]` is a special token: the HTTP API keeps special tokens
in the text of a request whose calls this parser reads (skip_special_tokens off, as vLLM does).
What is no call (not JSON, no name) stays in the content as written. Call ids are Mistral's: 9
letters and digits, which its chat templates ask of the calls in a chat's history."""

from __future__ import annotations

import random
import re
import string

from scheduler_service.json_tool_calls import JsonCallRun
from scheduler_service.reasoning import held_back
from scheduler_service.tool_calls import ToolCall, ToolCallDelta, _Brackets

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ID_CHARACTERS = string.ascii_letters + string.digits
# A function's name as OpenAI takes them (letters, digits, underscores, dashes; dots as some tools'),
# with the white space the model may write around it.
_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*")


def mistral_call_id() -> str:
    """9 letters and digits (mistral_common refuses other ids)."""
    return "".join(random.choices(_ID_CHARACTERS, k=9))


class MistralToolCallParser:
    """Feed content deltas to add(), then finish(); each returns (content delta, tool call
    deltas). `calls` holds the calls so far, whole."""

    # The HTTP API keeps special tokens in the text of requests this parser reads.
    keeps_special_tokens = True

    def __init__(self) -> None:
        # "text" (before [TOOL_CALLS]), "shape" (after it, before its first character), "array",
        # "named", "content" (what followed [TOOL_CALLS] was no call: all of it is content), "done"
        self._mode = "text"
        self._buffer = ""  # text not yet read
        self._raw = ""  # the text from [TOOL_CALLS] on, while it may yet turn out to be content
        self._run = JsonCallRun(",", "]", mistral_call_id, needs_arguments=False)
        # A named call's part: "name", "arguments" or "after" (what follows its arguments, up to
        # the next [TOOL_CALLS]).
        self._part = "name"
        self._arguments = _Brackets()
        self._named: list[ToolCall] = []

    @property
    def calls(self) -> list[ToolCall]:
        return self._run.calls if self._mode == "array" else self._named

    def add(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        deltas: list[ToolCallDelta] = []
        if self._mode == "content":
            return text, deltas
        if self._mode == "done":
            return "", deltas
        if not self.calls and self._mode != "text":
            self._raw += text
        self._buffer += text
        content = ""
        if self._mode == "text":
            start = self._buffer.find(TOOL_CALLS)
            if start < 0:
                keep = held_back(self._buffer, TOOL_CALLS)
                content, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                return content, deltas
            content, self._buffer = self._buffer[:start], self._buffer[start + len(TOOL_CALLS) :]
            self._raw, self._mode = TOOL_CALLS + self._buffer, "shape"
        if self._mode == "shape":
            head = self._buffer.lstrip()
            if not head:
                return content, deltas
            if head.startswith("["):
                self._mode, self._buffer = "array", head[1:]
            else:
                self._mode = "named"
        return content + self._read(deltas), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest: an answer that ended before its first call was read is content."""
        deltas: list[ToolCallDelta] = []
        if self._mode == "text":
            rest, self._buffer = self._buffer, ""
            return rest, deltas
        if self._mode == "shape":
            return self._fail(), deltas
        if self._mode == "array":
            self._run.finish(deltas)
            return self._array_state(), deltas
        if self._mode == "named" and self._part == "name":
            return self._fail(), deltas
        return "", deltas

    def _read(self, deltas: list[ToolCallDelta]) -> str:
        """The calls in the buffer; what goes to the content (all of it, if they were no calls)."""
        text, self._buffer = self._buffer, ""
        if self._mode == "array":
            self._run.add(text, deltas)
            return self._array_state()
        self._buffer = text
        return self._read_named(deltas)

    def _array_state(self) -> str:
        if self._run.state == "failed":
            return self._fail()
        if self.calls:
            self._raw = ""
        return ""

    def _read_named(self, deltas: list[ToolCallDelta]) -> str:
        while True:
            if self._part == "name":
                brace = self._buffer.find("{")
                if brace < 0:
                    name = self._buffer.replace(ARGS, "")
                    name = name[: len(name) - held_back(name, ARGS)]
                    return "" if not name.strip() or _NAME.fullmatch(name) else self._fail()
                match = _NAME.fullmatch(self._buffer[:brace].replace(ARGS, ""))
                if match is None:
                    return self._fail()
                call = ToolCall(len(self._named), mistral_call_id(), match.group(1), "")
                self._named.append(call)
                self._raw = ""
                deltas.append(ToolCallDelta(call.index, call.id, call.name, ""))
                self._part, self._arguments, self._buffer = "arguments", _Brackets(), self._buffer[brace:]
            next_call = self._buffer.find(TOOL_CALLS)
            readable = len(self._buffer) - held_back(self._buffer, TOOL_CALLS) if next_call < 0 else next_call
            piece = self._buffer[:readable]
            if self._part == "arguments":
                end = self._arguments.close(piece)
                sent = piece if end is None else piece[:end]
                if sent:
                    self._named[-1].arguments += sent
                    deltas.append(ToolCallDelta(len(self._named) - 1, arguments=sent))
                if end is not None:
                    self._part = "after"
            if next_call < 0:
                self._buffer = self._buffer[readable:]
                return ""
            self._buffer, self._part = self._buffer[next_call + len(TOOL_CALLS) :], "name"

    def _fail(self) -> str:
        """What followed [TOOL_CALLS] was no call: content as written, unless calls came before it
        (then it is dropped)."""
        self._buffer = ""
        if self.calls:
            self._mode = "done"
            return ""
        out, self._raw, self._mode = self._raw, "", "content"
        return out
