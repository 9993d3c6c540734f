"""Tool calls in the JSON format that Llama 3.1's chat template asks for, as vLLM's llama3_json
parser: an answer that is `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after
`<|python_tag|>` (a special token, in the text only when special tokens are kept) and with more
calls after `;`, is those calls; text after them is dropped (json_tool_calls.py streams them).

An answer is a call only when it begins with one (after white space): vLLM's streamed answers are
read so, while its whole ones take the first JSON object anywhere in the text; here both are read
as vLLM streams them, so that they agree. Until a call's header is read, an answer that begins with
`{` is held back: a JSON object that is no call (no name, or neither "parameters" nor "arguments")
is sent as content once it closes, as written, and so is all that follows. Call ids are vLLM's
(`chatcmpl-tool-...`)."""

from __future__ import annotations

from scheduler_service.json_tool_calls import JsonCallRun
from scheduler_service.tool_calls import ToolCall, ToolCallDelta, new_call_id

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolCallParser:
    """Feed content deltas to add(), then finish(); each returns (content delta, tool call
    deltas). `calls` holds the calls so far, whole."""

    def __init__(self) -> None:
        # "start" (the answer's beginning is not yet known), "calls" (it began with a call's object:
        # `_run` reads them), "content" (it is text)
        self._mode = "start"
        self._raw = ""  # the answer as written, while it may yet turn out to be content
        self._run = JsonCallRun(";", None, new_call_id, needs_arguments=True)

    @property
    def calls(self) -> list[ToolCall]:
        return self._run.calls

    def add(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        deltas: list[ToolCallDelta] = []
        if self._mode == "content":
            return text, deltas
        if not self.calls:
            self._raw += text
        if self._mode == "start":
            head = self._raw.lstrip()
            if head.startswith(PYTHON_TAG):
                text, self._mode = head[len(PYTHON_TAG) :], "calls"
            elif head.startswith("{"):
                text, self._mode = head, "calls"
            elif not head or PYTHON_TAG.startswith(head):
                return "", deltas
            else:
                return self._to_content(), deltas
        self._run.add(text, deltas)
        return self._after_run(), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest: an answer that ended before its first call was read is content."""
        deltas: list[ToolCallDelta] = []
        if self._mode == "start":
            return self._to_content(), deltas
        if self._mode == "calls":
            self._run.finish(deltas)
        return self._after_run(), deltas

    def _after_run(self) -> str:
        if self.calls:
            self._raw = ""
        return self._to_content() if self._run.state == "failed" else ""

    def _to_content(self) -> str:
        """What was held back, as content, and all that follows."""
        out, self._raw, self._mode = self._raw, "", "content"
        return out
