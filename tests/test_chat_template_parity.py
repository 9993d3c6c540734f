"""Chat templating against transformers' apply_chat_template, to the character and the token id,
with the chat templates Qwen3 and Llama 3.1 checkpoints ship (their tokenizer_config.json's
`chat_template`) written beside a small tokenizer: system, user, assistant and tool turns, tools,
past tool calls and reasoning, `add_generation_prompt`, `continue_final_message`, template kwargs
(`enable_thinking`, `date_string`), and a BOS the template writes itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.processors import TemplateProcessing

from protos.defaults import DEFAULT_MODEL
from scheduler_service.chat_template import ChatTemplate
from scheduler_service.errors import InvalidRequestError
from scheduler_service.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

# Qwen3's chat template (Qwen/Qwen3-8B's tokenizer_config.json).
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Llama 3.1's chat template (meta-llama/Llama-3.1-8B-Instruct's tokenizer_config.json).
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

BOS = "<|begin_of_text|>"
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", BOS,
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip


def _checkpoint(directory: Path, template: str) -> Path:
    """The embedded model's tokenizer with the templates' special tokens added and a BOS put
    before every text it encodes with special tokens (as Llama's tokenizer does), and `template`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = HFTokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))
    tokenizer.add_special_tokens(SPECIAL)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": "<|endoftext|>",
        "chat_template": template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=["qwen3", "llama31"])
def checkpoint(request, tmp_path_factory):
    """(the checkpoint, transformers' tokenizer of it)"""
    template = {"qwen3": QWEN3, "llama31": LLAMA31}[request.param]
    path = _checkpoint(tmp_path_factory.mktemp(request.param), template)
    return path, transformers.AutoTokenizer.from_pretrained(str(path))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather <now> & later, in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
CHATS = {
    "system-and-user": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi, ünïcode"},
    ],
    "turns": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
    "tool-turns": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ],
    "reasoning-in-history": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "about b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "<think>\nabout d\n</think>\n\nd"},
        {"role": "user", "content": "e"},
    ],
}


def _ids(encoded) -> list[int]:
    return encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "input_ids") else encoded


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"enable_thinking": False}, {"date_string": "1 Jan 2026"}],
    ids=["default", "no-thinking", "date"],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_and_tokenizes_as_transformers(checkpoint, chat, tools, kwargs, add_generation_prompt):
    """The text, and its token ids encoded without the tokenizer's own special tokens (the
    template writes its BOS: one, not two), as apply_chat_template(tokenize=True) gives them."""
    checkpoint, hf = checkpoint
    messages = CHATS[chat]
    options = {"tools": tools, "add_generation_prompt": add_generation_prompt, **kwargs}
    expected = hf.apply_chat_template(messages, tokenize=False, **options)
    got = ChatTemplate.load(checkpoint).render(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs
    )
    assert got == expected
    ids = Tokenizer(checkpoint).encode(got, add_special_tokens=False)
    assert ids == _ids(hf.apply_chat_template(messages, tokenize=True, **options))
    writes_bos = "bos_token" in ChatTemplate.load(checkpoint).source  # (Llama's does)
    assert ids.count(hf.convert_tokens_to_ids(BOS)) == (1 if writes_bos else 0)


@pytest.mark.parametrize(
    "final",
    [
        "The weather in Paris is",
        "  Sunny, with a chance of\n",
        # a markdown table begun for the model: "|" also ends the template's end-of-turn token,
        # where the prompt was cut ("...|<|im_end|" / "...|<|eot_id|")
        "|",
        # nothing yet, or only whitespace: the prompt opens the assistant's turn (a 400 before)
        "",
        " ",
    ],
)
def test_continue_final_message_cuts_as_transformers(checkpoint, final):
    checkpoint, hf = checkpoint
    messages = [*CHATS["system-and-user"], {"role": "assistant", "content": final}]
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    got = ChatTemplate.load(checkpoint).render(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert got == expected
    assert not got.endswith(("<|im_end|>\n", "<|eot_id|>"))


def test_continue_final_message_without_text_is_refused():
    template = ChatTemplate(QWEN3)
    for final in ({"role": "assistant", "content": None}, {"role": "assistant"}):
        with pytest.raises(InvalidRequestError, match="needs a final message with text content"):
            template.render([{"role": "user", "content": "a"}, final], add_generation_prompt=False,
                            continue_final_message=True)  # fmt: skip


def test_reasoning_in_history_reaches_the_template_under_either_name():
    """vLLM now names an answer's reasoning `reasoning` (it was `reasoning_content`), and takes a
    past turn's `reasoning` back as the template's `reasoning_content`, which Qwen3's template
    reads. Sent as `reasoning`, it was dropped: the past turn rendered with an empty <think>."""
    template = ChatTemplate(QWEN3)
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
    ]
    expected = template.render([turns[0], {**turns[1], "reasoning_content": "Ask the tool."}, turns[2]])
    assert "<think>\nAsk the tool.\n</think>" in expected
    assert template.render([turns[0], {**turns[1], "reasoning": "Ask the tool."}, turns[2]]) == expected
    # (a message's own reasoning_content wins, as the template reads it)
    both = {**turns[1], "reasoning": "other", "reasoning_content": "Ask the tool."}
    assert template.render([turns[0], both, turns[2]]) == expected
