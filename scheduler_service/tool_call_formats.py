"""The tool-call formats a chat answer is read in, named as vLLM's --tool-call-parser names them:
hermes (tool_calls.py: Qwen2, Qwen2.5, Qwen3, Qwen3-MoE and Hermes fine-tunes), llama3_json
(llama_tool_calls.py: Llama 3.1 to 3.3) and mistral (mistral_tool_calls.py). vLLM serves tool calls
only with --enable-auto-tool-choice and a parser named; this server always reads them when a request
gives tools (tool_choice "auto" or none given; "none" turns them off), in the format that
--tool-call-parser names or, by default ("auto"), the checkpoint's: its chat template's when that
writes one format's markup, else its architecture's, else Hermes (as before there was a choice)."""

from __future__ import annotations

from scheduler_service.chat_template import ChatTemplate
from scheduler_service.llama_tool_calls import PYTHON_TAG, Llama3JsonToolCallParser
from scheduler_service.mistral_tool_calls import TOOL_CALLS, MistralToolCallParser
from scheduler_service.tool_calls import TOOL_CALL_START, ToolCallParser

AUTO = "auto"
TOOL_CALL_PARSERS: dict[str, type] = {
    "hermes": ToolCallParser,
    "llama3_json": Llama3JsonToolCallParser,
    "mistral": MistralToolCallParser,
}
CHOICES = (AUTO, *TOOL_CALL_PARSERS)

ToolParser = ToolCallParser | Llama3JsonToolCallParser | MistralToolCallParser

# What a chat template writes (in a past call, or in its instructions) that tells its format; the
# first found wins: Hermes fine-tunes of Llama and Mistral checkpoints ask for <tool_call>.
_TEMPLATE_MARKS = (
    (TOOL_CALL_START, "hermes"),
    (TOOL_CALLS, "mistral"),
    (PYTHON_TAG, "llama3_json"),
)
# A template that tells none: the architecture's format, where one family ships it. (Llama's is left
# out: LlamaForCausalLM is Llama 2's and many fine-tunes' too, which write other formats.)
_ARCHITECTURES = {
    "Qwen2ForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
    "Qwen3MoeForCausalLM": "hermes",
    "MistralForCausalLM": "mistral",
}
DEFAULT = "hermes"


def check_tool_call_parser(name: str) -> str:
    """ValueError naming the choices unless `name` is one (the --tool-call-parser flag's check)."""
    if name not in CHOICES:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(CHOICES)}, got {name!r}")
    return name


def tool_call_format(choice: str, template: ChatTemplate, architecture: str = "") -> str:
    """The format `choice` (--tool-call-parser) names; for "auto", the checkpoint's."""
    if choice != AUTO:
        return choice
    source = (template.tool_use_source or "") + template.source  # (the tool_use template first)
    for mark, name in _TEMPLATE_MARKS:
        if mark in source:
            return name
    return _ARCHITECTURES.get(architecture, DEFAULT)


def new_tool_call_parser(name: str) -> ToolParser:
    return TOOL_CALL_PARSERS[name]()


def keeps_special_tokens(name: str) -> bool:
    """Whether the format's markup is a special token, which the answer's text must keep."""
    return getattr(TOOL_CALL_PARSERS[name], "keeps_special_tokens", False)
