"""A chat answer's text as OpenAI's chat API returns it: a Qwen3 `<think>` block as
`reasoning_content` (reasoning.py), tool calls as `tool_calls` (in the format tool_call_formats.py
names: Hermes, Llama 3's JSON or Mistral's), the rest as `content`. The HTTP API and gRPC's Chat
prompt split answers with it alike, whole or streamed."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.chat_template import ChatTemplate
from scheduler_service.reasoning import ReasoningParser
from scheduler_service.tool_call_formats import DEFAULT, ToolParser, new_tool_call_parser
from scheduler_service.tool_calls import ToolCall, ToolCallDelta


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChatOutputParser:
    """Feed text deltas to add() (`last` on the final one)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @classmethod
    def for_request(
        cls, template: ChatTemplate, prompt: str, parses_tools: bool, tool_format: str = DEFAULT
    ) -> ChatOutputParser | None:
        """The parser an answer to `prompt` (rendered by `template`) needs: reasoning when the
        template writes `<think>` blocks, tool calls in `tool_format` (tool_call_formats.py) when
        the request gave tools; None for neither."""
        reasoning = ReasoningParser(prompt) if template.thinks else None
        tools = new_tool_call_parser(tool_format) if parses_tools else None
        return cls(reasoning, tools) if reasoning is not None or tools is not None else None

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def add(self, text: str, last: bool = False) -> ChatDelta:
        delta = ChatDelta(content=text)
        if self.reasoning is not None:
            delta.reasoning, delta.content = self.reasoning.add(text)
            if last:
                more_reasoning, more = self.reasoning.finish()
                delta.reasoning += more_reasoning
                delta.content += more
        if self.tools is not None:
            delta.content, delta.tool_calls = self.tools.add(delta.content)
            if last:
                more, more_calls = self.tools.finish()
                delta.content += more
                delta.tool_calls += more_calls
        return delta
