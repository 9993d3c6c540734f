"""Chat without services: the template renders as transformers' apply_chat_template does, and the
Qwen3 reasoning split and Hermes tool calls give the same answer whole and streamed in any pieces."""

from __future__ import annotations

import json

import pytest
from helpers.chat_checkpoint import QWEN3_TEMPLATE, chat_checkpoint

from scheduler_service.chat_template import ChatTemplate
from scheduler_service.errors import InvalidRequestError
from scheduler_service.reasoning import ReasoningParser
from scheduler_service.tool_calls import ToolCallParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris? ünïcode"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "sunny"},
]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"tools": TOOLS}])
def test_template_renders_as_transformers(tmp_path, kwargs):
    transformers = pytest.importorskip("transformers")
    checkpoint = chat_checkpoint(tmp_path / "ckpt")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    template = ChatTemplate.load(checkpoint)
    assert template.render(MESSAGES, add_generation_prompt=True, **kwargs) == expected


def test_raise_exception_is_a_400():
    with pytest.raises(InvalidRequestError, match="unknown role"):
        ChatTemplate(QWEN3_TEMPLATE).render([{"role": "robot", "content": "x"}])


def _split(output: str, pieces: int, prompt: str = "", tools: bool = True):
    reasoning_parser, tool_parser = ReasoningParser(prompt), ToolCallParser()
    reasoning, content, calls = [], [], []
    step = max(1, len(output) // pieces) if pieces else len(output) or 1
    chunks = [output[i : i + step] for i in range(0, len(output), step)] or [""]
    for i, chunk in enumerate(chunks):
        r, c = reasoning_parser.add(chunk)
        if i == len(chunks) - 1:
            r2, c2 = reasoning_parser.finish()
            r, c = r + r2, c + c2
        if tools:
            c, new = tool_parser.add(c)
            calls += new
            if i == len(chunks) - 1:
                c2, new = tool_parser.finish()
                c, calls = c + c2, calls + new
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content), [(t.name, json.loads(t.arguments)) for t in calls]


OUTPUTS = {
    "<think>\nLet me see.\n</think>\n\nIt is sunny.": ("\nLet me see.\n", "\n\nIt is sunny.", []),
    "Just an answer.": ("", "Just an answer.", []),
    '<think>hm</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>': (
        "hm",
        "\n\n",
        [("get_weather", {"city": "Paris"})],
    ),
    'Calling.<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b"}</tool_call>': (
        "",
        "Calling.",
        [("a", {}), ("b", {})],
    ),
    "<tool_call>not json</tool_call>": ("", "<tool_call>not json</tool_call>", []),
    "<think>cut off": ("cut off", "", []),
}


@pytest.mark.parametrize("output", list(OUTPUTS))
@pytest.mark.parametrize("pieces", [0, 1, 3, 1000])
def test_whole_and_streamed_splits_agree(output, pieces):
    assert _split(output, pieces) == OUTPUTS[output]


def test_a_block_opened_by_the_prompt_is_reasoning():
    assert _split("thinking</think>answer", 5, prompt="<|im_start|>assistant\n<think>\n") == (
        "thinking",
        "answer",
        [],
    )
