"""Tool calls in the formats vLLM's --tool-call-parser names for the families this server serves,
beside Hermes (test_chat_parsing.py): Llama 3's JSON (llama3_json) and Mistral's [TOOL_CALLS]
(mistral), each the same whole, in a few pieces and one character at a time; call ids in each
format's style; the default format per checkpoint (its chat template, else its architecture) and
--tool-call-parser over it; and, through the HTTP API with Llama 3.1's and Mistral 7B v0.3's own chat
templates, finish_reason "tool_calls", streamed calls equal to whole ones, tool_choice "none", and a
history message with `content: null` rendered as vLLM renders it ("")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from helpers.chat_templates import LLAMA31, MISTRAL, QWEN3
from helpers.fake_executor import ScriptedExecutor
from helpers.scheduler_server import wait_http_health
from tokenizers import Tokenizer as HFTokenizer

from protos.defaults import DEFAULT_MODEL
from scheduler_service.async_engine import EngineOptions
from scheduler_service.chat_output import ChatOutputParser
from scheduler_service.chat_template import ChatTemplate
from scheduler_service.config import SchedulerConfig
from scheduler_service.openai_protocol import ChatRequest
from scheduler_service.server import SchedulerServer, ServerThread
from scheduler_service.tokenizer import Tokenizer
from scheduler_service.tool_call_formats import check_tool_call_parser, new_tool_call_parser, tool_call_format

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("get_weather", "get_time")
]
MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]
HERMES_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _split(fmt: str, output: str, pieces: int):
    """(content, [(name, arguments)], ids) of `output` fed in `pieces` pieces (0: whole, a count
    past its length: a character at a time); each call's first delta names it, the others add to
    its arguments, which stay the model's text."""
    parser = ChatOutputParser(None, new_tool_call_parser(fmt))
    step = max(1, len(output) // pieces) if pieces else len(output) or 1
    chunks = [output[i : i + step] for i in range(0, len(output), step)] or [""]
    content, calls = [], {}
    for i, chunk in enumerate(chunks):
        delta = parser.add(chunk, last=i == len(chunks) - 1)
        content.append(delta.content)
        for d in delta.tool_calls:
            if d.id is not None:
                assert d.index not in calls and d.index == len(calls)
                calls[d.index] = [d.id, d.name, d.arguments]
            else:
                calls[d.index][2] += d.arguments
    assert [[c.id, c.name, c.arguments] for c in parser.calls] == list(calls.values())
    return (
        "".join(content),
        [(name, args) for _, name, args in calls.values()],
        [i for i, _, _ in calls.values()],
    )


LLAMA_OUTPUTS = {
    # Llama 3.1's format: "parameters"; the arguments are the model's text
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}': (
        "",
        [("get_weather", '{"city": "Paris", "unit": "°C"}')],
    ),
    # <|python_tag|> (kept when special tokens are), white space, "arguments", calls after ";"
    '\n<|python_tag|>{"name": "a", "arguments": {"x": [1, "}"]}}; {"name": "b", "parameters": {}}': (
        "",
        [("a", '{"x": [1, "}"]}'), ("b", "{}")],
    ),
    # what follows the calls is dropped
    '{"name": "a", "parameters": {"x": 1}} Let me know.': ("", [("a", '{"x": 1}')]),
    # keys in another order: parsed when the object closes
    '{"parameters": {"x": 1}, "name": "a"}': ("", [("a", '{"x": 1}')]),
    # not a call: a JSON answer (no name, or no arguments), text first, not JSON: content as written
    '{"answer": 42}': ('{"answer": 42}', []),
    '{"name": "Ada", "age": 36}\nShe was a mathematician.': (
        '{"name": "Ada", "age": 36}\nShe was a mathematician.',
        [],
    ),
    'It is {"name": "a", "parameters": {}}': ('It is {"name": "a", "parameters": {}}', []),
    "{not json} at all": ("{not json} at all", []),
    "Just an answer.": ("Just an answer.", []),
    "<|python_tag": ("<|python_tag", []),
    # a call the answer ends in (max_tokens) stays a call, its arguments cut short
    '{"name": "a", "parameters": {"x": [1, 2': ("", [("a", '{"x": [1, 2')]),
}


@pytest.mark.parametrize("output", list(LLAMA_OUTPUTS))
@pytest.mark.parametrize("pieces", [0, 3, 1000])
def test_llama3_json_whole_and_streamed_agree(output, pieces):
    content, calls, ids = _split("llama3_json", output, pieces)
    assert (content, calls) == LLAMA_OUTPUTS[output]
    assert all(HERMES_ID.fullmatch(i) for i in ids)  # vLLM's ids for Llama's calls


MISTRAL_OUTPUTS = {
    # before its v11 tokenizer: an array after [TOOL_CALLS]; the content before it stays
    'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]': (
        "Sure.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')],
    ),
    # Nemo's (no space), keys in another order, no arguments, what follows the array dropped
    '[TOOL_CALLS][{"arguments": {"a": "]"}, "name": "f"}, {"name": "g"}]</s> trailing': (
        "",
        [("f", '{"a": "]"}'), ("g", "{}")],
    ),
    # v11 and later: name{arguments} per call, v13's [ARGS] between them
    '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "[CET]"}': (
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "[CET]"}')],
    ),
    # what is no call stays content as written; a text with no mark is content
    "[TOOL_CALLS] I cannot call a tool.": ("[TOOL_CALLS] I cannot call a tool.", []),
    "[TOOL_CALLS] [not json]": ("[TOOL_CALLS] [not json]", []),
    "[TOOL_CALLS] []": ("[TOOL_CALLS] []", []),
    "An answer with [brackets] and [TOOL": ("An answer with [brackets] and [TOOL", []),
    # a call the answer ends in stays a call
    '[TOOL_CALLS]f{"a": [1': ("", [("f", '{"a": [1')]),
}


@pytest.mark.parametrize("output", list(MISTRAL_OUTPUTS))
@pytest.mark.parametrize("pieces", [0, 3, 1000])
def test_mistral_whole_and_streamed_agree(output, pieces):
    content, calls, ids = _split("mistral", output, pieces)
    assert (content, calls) == MISTRAL_OUTPUTS[output]
    assert all(MISTRAL_ID.fullmatch(i) for i in ids)  # mistral_common takes no other ids
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    ("fmt", "output", "arguments"),
    [
        (
            "llama3_json",
            '{"name": "f", "parameters": {"city": "Paris", "unit": "C"}}',
            '{"city": "Paris", "unit": "C"}',
        ),
        (
            "mistral",
            '[TOOL_CALLS] [{"name": "f", "arguments": {"city": "Paris", "unit": "C"}}]',
            '{"city": "Paris", "unit": "C"}',
        ),
        ("mistral", '[TOOL_CALLS]f{"city": "Paris", "unit": "C"}', '{"city": "Paris", "unit": "C"}'),
    ],
)
def test_arguments_stream_as_the_model_writes_them(fmt, output, arguments):
    parser = new_tool_call_parser(fmt)
    deltas = []
    for ch in output:
        deltas += parser.add(ch)[1]
    deltas += parser.finish()[1]
    assert (deltas[0].index, deltas[0].name, deltas[0].arguments) == (0, "f", "")
    fragments = [d.arguments for d in deltas[1:]]
    assert len(fragments) > 10 and all(d.id is None for d in deltas[1:])
    assert "".join(fragments) == arguments == parser.calls[0].arguments


def test_the_default_format_is_the_checkpoints():
    """The chat template's markup decides; without any, the architecture; else Hermes. A Hermes
    fine-tune of a Mistral or Llama checkpoint asks for <tool_call>; --tool-call-parser wins."""
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tool_call_format("auto", ChatTemplate(QWEN3), "Qwen3ForCausalLM") == "hermes"
    assert tool_call_format("auto", ChatTemplate(LLAMA31), "LlamaForCausalLM") == "llama3_json"
    assert tool_call_format("auto", ChatTemplate(MISTRAL), "MistralForCausalLM") == "mistral"
    assert tool_call_format("auto", ChatTemplate(QWEN3), "MistralForCausalLM") == "hermes"
    for architecture, fmt in [
        ("Qwen2ForCausalLM", "hermes"),
        ("Qwen3MoeForCausalLM", "hermes"),
        ("MistralForCausalLM", "mistral"),
        ("LlamaForCausalLM", "hermes"),  # (Llama 2's and many fine-tunes' architecture too)
        ("", "hermes"),
    ]:
        assert tool_call_format("auto", plain, architecture) == fmt
    assert tool_call_format("hermes", ChatTemplate(LLAMA31), "LlamaForCausalLM") == "hermes"
    assert tool_call_format("mistral", plain, "Qwen3ForCausalLM") == "mistral"
    with pytest.raises(ValueError, match="must be one of auto, hermes, llama3_json, mistral, got 'pythonic'"):
        check_tool_call_parser("pythonic")


@pytest.mark.parametrize("template", [LLAMA31, MISTRAL], ids=["llama31", "mistral"])
def test_a_null_content_reaches_the_template_as_vllm_gives_it(template):
    """A history message with `content: null` (an assistant's turn with tool calls, as clients
    send it back) reached the template as None: Mistral's template refused the chat ("can only
    concatenate str") and Llama 3.1's wrote "None". vLLM gives the template "" instead."""
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    chat = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": None},
    ]
    request = ChatRequest(messages=chat, tools=TOOLS)
    rendered = request.render(ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"}))
    empty = [{**m, "content": m["content"] or ""} for m in chat]
    assert rendered == ChatRequest(messages=empty, tools=TOOLS).render(
        ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"})
    )
    assert "None" not in rendered


# -- through the HTTP API ------------------------------------------------------------------------

LLAMA_ANSWER = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}'
MISTRAL_ANSWER = (
    'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, '
    '{"name": "get_time", "arguments": {"zone": "CET"}}]'
)
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>",
           "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]  # fmt: skip


def _checkpoint(directory: Path, template: str) -> Path:
    """The embedded model's tokenizer with the templates' special tokens added, and `template`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = HFTokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=["llama31", "mistral", "llama31-as-hermes"])
def served(request, tmp_path_factory):
    """(the OpenAI client, the family's answer, the format it is read in) of an in-process scheduler
    whose checkpoint has the family's template and whose executor writes its answer."""
    template, answer, architecture, flag, fmt = {
        "llama31": (LLAMA31, LLAMA_ANSWER, "LlamaForCausalLM", "auto", "llama3_json"),
        "mistral": (MISTRAL, MISTRAL_ANSWER, "MistralForCausalLM", "auto", "mistral"),
        "llama31-as-hermes": (LLAMA31, LLAMA_ANSWER, "LlamaForCausalLM", "hermes", "hermes"),
    }[request.param]
    tokenizer = Tokenizer(_checkpoint(tmp_path_factory.mktemp(request.param), template))
    script = tokenizer.encode(answer, add_special_tokens=False)
    # (a token a step: streams come in pieces)
    executor = ScriptedExecutor(
        script, eos=0, vocab_size=tokenizer.vocab_size, pause=0.002, architecture=architecture
    )
    options = EngineOptions(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024))
    server = SchedulerServer(
        executor, options, tokenizer_for=lambda info: tokenizer, port=0, http_port=0, tool_call_parser=flag
    )
    with ServerThread(server):
        wait_http_health(f"http://127.0.0.1:{server.http_port}")
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="x", max_retries=0)
        yield api, answer, fmt


def _whole(api, **kwargs):
    return api.chat.completions.create(
        model="fake", messages=MESSAGES, max_tokens=200, temperature=0, **kwargs
    )


def _streamed(api, **kwargs) -> tuple[str, list[dict], str]:
    """(content, calls as {"id", "name", "arguments"}, finish_reason) of a streamed answer."""
    content, calls, finish = "", {}, None
    for chunk in _whole(api, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                if call.id is not None:
                    assert call.index == len(calls) and call.type == "function" and call.function.name
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, list(calls.values()), finish


def test_the_familys_calls_whole_and_streamed(served):
    api, answer, fmt = served
    whole = _whole(api, tools=TOOLS).choices[0]
    content, calls, finish = _streamed(api, tools=TOOLS)
    if fmt == "hermes":  # (--tool-call-parser hermes: Llama's JSON is no Hermes call)
        assert (whole.finish_reason, whole.message.tool_calls, finish, calls) == ("stop", [], "stop", [])
        assert whole.message.content == content == answer.removeprefix("<|python_tag|>")
        return
    got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    expected = [("get_weather", {"city": "Paris", "unit": "°C"})]
    if fmt == "mistral":
        expected.append(("get_time", {"zone": "CET"}))
    assert got == expected and whole.finish_reason == finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert (whole.message.content, content) == (
        ("Checking.", "Checking.") if fmt == "mistral" else (None, "")
    )
    id_style = MISTRAL_ID if fmt == "mistral" else HERMES_ID
    assert all(id_style.fullmatch(c.id) for c in whole.message.tool_calls)
    assert all(id_style.fullmatch(c["id"]) for c in calls)


def test_tool_choice_none_leaves_the_answer_as_text(served):
    """tool_choice "none", or no tools: nothing is parsed, and special tokens stay out of the text
    as the request asks (only a request whose Mistral calls are read keeps [TOOL_CALLS])."""
    api, answer, _ = served
    text = re.sub(r"<\|python_tag\|>|\[TOOL_CALLS\]", "", answer)
    for kwargs in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        whole = _whole(api, **kwargs).choices[0]
        assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == (text, [], "stop")
        assert _streamed(api, **kwargs) == (text, [], "stop")


def test_the_mistral_calls_mark_is_kept_only_for_tools(served):
    """[TOOL_CALLS] is a special token: with skip_special_tokens (the default) the mark was left out of
    the text and the calls came back as content. vLLM keeps special tokens for a request whose
    Mistral calls are read; so does this server."""
    api, _, fmt = served
    if fmt != "mistral":
        pytest.skip("Mistral's format only")
    body = {
        "model": "fake",
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 200,
        "skip_special_tokens": True,
    }
    url = str(api.base_url).rstrip("/") + "/chat/completions"
    message = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
    assert message["content"] == "Checking." and len(message["tool_calls"]) == 2
