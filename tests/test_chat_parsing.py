"""Chat without services: the template renders as transformers' apply_chat_template does, and the
Qwen3 reasoning split and Hermes tool calls give the same answer whole and streamed in any pieces."""

from __future__ import annotations

import json

import pytest
from helpers.chat_checkpoint import QWEN3_TEMPLATE, chat_checkpoint

from scheduler_service.chat_output import ChatOutputParser
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
    assert template.render(MESSAGES, add_generation_prompt=True, chat_template_kwargs=kwargs) == expected


@pytest.mark.parametrize(
    "final",
    [
        "The weather in Paris is",  # no surrounding whitespace
        "  Sunny, with a chance of\n",  # whitespace the template strips
        '{"city": "Paris", "sky": ',  # JSON started for the model
    ],
)
def test_continue_final_message_renders_as_transformers(tmp_path, final):
    """continue_final_message (vLLM's, transformers' apply_chat_template's): the prompt ends right
    after the final message's text, with no end of turn, whatever whitespace the template strips."""
    transformers = pytest.importorskip("transformers")
    checkpoint = chat_checkpoint(tmp_path / "ckpt")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    messages = [*MESSAGES[:2], {"role": "assistant", "content": final}]
    expected = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    template = ChatTemplate.load(checkpoint)
    got = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert got == expected
    assert got.rstrip().endswith(final.strip()) and "<|im_end|>" not in got[got.rindex("assistant") :]


def test_continue_final_message_refusals_name_the_reason():
    template = ChatTemplate(QWEN3_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(InvalidRequestError, match="add_generation_prompt cannot both be true"):
        template.render(messages, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="needs a final message with text"):
        template.render([*messages[:1], {"role": "assistant", "content": None}], add_generation_prompt=False,
                        continue_final_message=True)  # fmt: skip


def test_raise_exception_is_a_400():
    with pytest.raises(InvalidRequestError, match="unknown role"):
        ChatTemplate(QWEN3_TEMPLATE).render([{"role": "robot", "content": "x"}])


def test_a_tool_nested_too_deeply_for_tojson_is_a_400():
    """A JSON body a little under the parser's nesting limit passed, then overflowed the stack in
    the template's tojson: a RecursionError, a bare 500 (an UNKNOWN status over gRPC)."""
    parameters: list = []
    for _ in range(100_000):
        parameters = [parameters]
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(InvalidRequestError, match="could not render the messages: maximum recursion depth"):
        ChatTemplate(QWEN3_TEMPLATE).render([{"role": "user", "content": "x"}], tools=tools)


def _split(output: str, pieces: int, prompt: str = "", tools: bool = True):
    """(reasoning, content, [(name, arguments)]) of `output` fed in `pieces` pieces; each call's
    first delta names it, the others add to its arguments."""
    parser = ChatOutputParser(ReasoningParser(prompt), ToolCallParser() if tools else None)
    reasoning, content, calls = [], [], {}
    step = max(1, len(output) // pieces) if pieces else len(output) or 1
    chunks = [output[i : i + step] for i in range(0, len(output), step)] or [""]
    for i, chunk in enumerate(chunks):
        delta = parser.add(chunk, last=i == len(chunks) - 1)
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        for d in delta.tool_calls:
            if d.id is not None:
                assert d.index not in calls and d.index == len(calls)
                calls[d.index] = [d.name, d.arguments]
            else:
                calls[d.index][1] += d.arguments
    assert [[c.name, c.arguments] for c in parser.calls] == list(calls.values())
    return "".join(reasoning), "".join(content), [(name, json.loads(args)) for name, args in calls.values()]


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
    # arguments before the name: parsed when the block closes
    '<tool_call>{"arguments": {"x": [1, {"y": 2}]}, "name": "f"}</tool_call>': (
        "",
        "",
        [("f", {"x": [1, {"y": 2}]})],
    ),
    # arguments as a JSON string
    '<tool_call>{"name": "g", "arguments": "{\\"q\\": \\"}\\"}"}</tool_call>': ("", "", [("g", {"q": "}"})]),
    # what the model writes after the arguments' object (another key, a stray brace, text) is no
    # part of them: it made them invalid JSON, the outer object's rest sent as arguments
    '<tool_call>{"name": "f", "arguments": {"a": [1, "]}"]}, "id": "call_9"}</tool_call>': (
        "",
        "",
        [("f", {"a": [1, "]}"]})],
    ),
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}}\n</tool_call>': ("", "", [("f", {"a": 1})]),
    '<tool_call>{"name": "f", "arguments": [1, 2]} oops</tool_call>': ("", "", [("f", [1, 2])]),
    # Llama 3's "parameters" for the arguments: they were dropped (the call's arguments {})
    '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>': ("", "", [("f", {"a": 1})]),
    # a block the answer ends in, and braces inside the arguments' strings
    '<tool_call>\n{"name": "h", "arguments": {"s": "} }", "n": {}}}\n': (
        "",
        "",
        [("h", {"s": "} }", "n": {}})],
    ),
}


@pytest.mark.parametrize("output", list(OUTPUTS))
@pytest.mark.parametrize("pieces", [0, 1, 3, 1000])
def test_whole_and_streamed_splits_agree(output, pieces):
    assert _split(output, pieces) == OUTPUTS[output]


@pytest.mark.parametrize(
    "arguments",
    ["1" * 5000, "[" * 100_000 + "]" * 100_000, '"' + "[" * 100_000 + '"'],
    ids=["integer-of-5000-digits", "nested-100000-deep", "a-string"],
)
@pytest.mark.parametrize("pieces", [0, 7])
def test_a_call_json_cannot_take_stays_text_whatever_the_model_wrote(arguments, pieces):
    """A model may write anything in a call: an integer past Python's 4,300 digits or arrays nested
    past the parser's recursion limit raised out of the parser (ValueError, RecursionError), ending
    the response with an error. Now such a block is no call and stays in the content; a string of
    brackets is a call's arguments as written."""
    text = 'Calling.<tool_call>{"arguments": ' + arguments + ', "name": "f"}</tool_call>'
    parser = ChatOutputParser(None, ToolCallParser())
    step = max(1, len(text) // pieces) if pieces else len(text)
    content = "".join(
        parser.add(text[i : i + step], last=i + step >= len(text)).content for i in range(0, len(text), step)
    )
    if arguments.startswith('"'):
        assert (content, [(c.name, c.arguments) for c in parser.calls]) == (
            "Calling.",
            [("f", arguments[1:-1])],
        )
    else:
        assert (content, parser.calls) == (text, [])


def test_a_block_opened_by_the_prompt_is_reasoning():
    assert _split("thinking</think>answer", 5, prompt="<|im_start|>assistant\n<think>\n") == (
        "thinking",
        "answer",
        [],
    )


def test_tool_call_arguments_stream_as_the_model_writes_them():
    parser = ToolCallParser()
    deltas = []
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    for ch in text:
        deltas += parser.add(ch)[1]
    deltas += parser.finish()[1]
    assert (deltas[0].index, deltas[0].name, deltas[0].arguments) == (0, "get_weather", "")
    assert deltas[0].to_openai()["type"] == "function" and deltas[0].id.startswith("chatcmpl-tool-")
    fragments = [d.arguments for d in deltas[1:]]
    assert len(fragments) > 10 and all(d.id is None for d in deltas[1:])
    assert "".join(fragments) == '{"city": "Paris", "unit": "C"}' == parser.calls[0].arguments
    assert deltas[1].to_openai() == {"index": 0, "function": {"arguments": fragments[0]}}


@pytest.mark.parametrize("arguments", ['{"a": "\\udc00"}', '"\\ud800 as a string"'])
@pytest.mark.parametrize("step", [1, 1000])
def test_a_call_whose_json_decodes_to_a_lone_surrogate_is_sent_escaped(arguments, step):
    """A model may write "\\ud800" in a call's name or arguments; decoded, it is a lone surrogate,
    which UTF-8 cannot encode: the HTTP response was a 500 and gRPC's an UNKNOWN. The call's text
    keeps the escape instead."""
    text = '<tool_call>\n{"name": "f\\ud800", "arguments": ' + arguments + "}\n</tool_call>"
    parser = ToolCallParser()
    deltas = []
    for i in range(0, len(text), step):
        deltas += parser.add(text[i : i + step])[1]
    deltas += parser.finish()[1]
    assert [c.name for c in parser.calls] == ["f\\ud800"]
    for value in (
        [c.arguments for c in parser.calls] + [d.name or "" for d in deltas] + [d.arguments for d in deltas]
    ):
        value.encode("utf-8")  # raises on a lone surrogate
