"""A checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it, without
torch: Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls, the
`{% generation %}` tag, transformers' `tojson` (no HTML escaping, ensure_ascii off), and the globals
`raise_exception` and `strftime_now`. The template comes from `chat_template.jinja` beside the
tokenizer or from `chat_template` in tokenizer_config.json; the special tokens there (bos_token,
eos_token, ...) are passed to it as transformers passes them. As in vLLM, an assistant message's
`reasoning` (vLLM's name for it) reaches the template as `reasoning_content` too, the name that
templates such as Qwen3's read."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from scheduler_service.errors import InvalidRequestError

_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Appended to the final message's text to find where it ends in the rendered chat (transformers'
# marker for continue_final_message, so that both cut a template's output alike).
_CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # an AddedToken as tokenizer_config.json writes it
        return token.get("content")
    return token if isinstance(token, str) else None


def _directory(checkpoint: str | Path) -> Path:
    path = Path(checkpoint)
    return path if path.is_dir() else path.parent


def _tokenizer_config(path: Path) -> dict[str, Any]:
    """The checkpoint directory's tokenizer_config.json ({} without one)."""
    if (path / "tokenizer_config.json").exists():
        return json.loads((path / "tokenizer_config.json").read_text())
    return {}


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The special tokens (bos_token, eos_token, ...) a tokenizer_config.json names, as text."""
    return {name: text for name in _SPECIAL_TOKENS if (text := _token_text(config.get(name)))}


class ChatTemplate:
    def __init__(
        self, source: str, special_tokens: dict[str, str] | None = None, tool_use_source: str | None = None
    ) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        # A checkpoint's named "tool_use" template: rendered for requests with tools, as transformers does.
        self.tool_use_source = tool_use_source

    @classmethod
    def load(cls, checkpoint: str | Path) -> ChatTemplate | None:
        """The template of the checkpoint directory (None when it has none)."""
        path = _directory(checkpoint)
        config = _tokenizer_config(path)
        source = config.get("chat_template")
        if (path / "chat_template.jinja").exists():
            source = (path / "chat_template.jinja").read_text()
        tool_use = None
        if isinstance(source, list):  # named templates: "default", and "tool_use" for tools (transformers')
            named = {t["name"]: t["template"] for t in source}
            source, tool_use = named.get("default"), named.get("tool_use")
        if not source:
            return None
        return cls(source, _special_tokens(config), tool_use)

    @classmethod
    def given(cls, source: str, checkpoint: str | Path) -> ChatTemplate:
        """`source` (a template passed in, as the offline LLM's chat_template) with the checkpoint's
        special tokens, whether or not the checkpoint has a template of its own."""
        return cls(source, _special_tokens(_tokenizer_config(_directory(checkpoint))))

    @cached_property
    def _template(self) -> jinja2.Template:
        return _environment().from_string(self.source)

    @cached_property
    def _tool_use_template(self) -> jinja2.Template | None:
        return _environment().from_string(self.tool_use_source) if self.tool_use_source else None

    @cached_property
    def thinks(self) -> bool:
        """The template writes Qwen3-style `<think>` blocks: outputs get a reasoning split."""
        return "</think>" in self.source

    @cached_property
    def calls_tools(self) -> bool:
        """The template (or its tool_use one) describes Hermes-style `<tool_call>` outputs."""
        return "<tool_call>" in self.source + (self.tool_use_source or "")

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text; raises InvalidRequestError for what the template refuses
        (raise_exception) or cannot render. `chat_template_kwargs` (the request's) override the
        special tokens, tools, documents and add_generation_prompt, as in vLLM; not messages.
        continue_final_message: the prompt ends inside the final message, right after its text (no
        end of turn), so that the model continues it, as transformers' apply_chat_template cuts it."""
        kwargs = chat_template_kwargs or {}
        if "messages" in kwargs:
            raise InvalidRequestError("chat_template_kwargs may not set 'messages': send them as messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true: the prompt either "
                "continues the final message or opens a new one (send add_generation_prompt: false)"
            )
        variables = {"tools": tools, "documents": documents, "add_generation_prompt": add_generation_prompt}
        messages = _with_reasoning_content(messages)
        final_text = ""
        if continue_final_message:
            final, final_text = _marked_final_message(messages)
            messages = [*messages[:-1], final]
        template = (
            self._tool_use_template if tools is not None and self._tool_use_template else self._template
        )
        try:
            rendered = template.render(messages=messages, **{**variables, **self.special_tokens, **kwargs})
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequestError(f"the chat template refused the messages: {e}") from None
        # (RecursionError: a value nested too deeply for the template's tojson)
        except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
            raise InvalidRequestError(f"the chat template could not render the messages: {e}") from None
        return _cut_at_marker(rendered, final_text) if continue_final_message else rendered


def _with_reasoning_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages`, an assistant's `reasoning` given to the template as `reasoning_content` too
    (where the message has none of its own), as vLLM gives it."""
    out = []
    for message in messages:
        if (
            isinstance(message, dict)
            and message.get("role") == "assistant"
            and isinstance(message.get("reasoning"), str)
            and message.get("reasoning_content") is None
        ):
            message = {**message, "reasoning_content": message["reasoning"]}
        out.append(message)
    return out


def _marked_final_message(messages: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """A copy of the final message whose text (its content, or its last text part) ends with the
    marker, as transformers' apply_chat_template marks it, and that text. Any text may be
    continued, even none."""
    final = dict(messages[-1]) if messages and isinstance(messages[-1], dict) else {}
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_MARKER
        return final, content
    if isinstance(content, list):
        parts = list(content)
        for i in reversed(range(len(parts))):
            part = parts[i]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts[i] = {**part, "text": part["text"] + _CONTINUE_MARKER}
                final["content"] = parts
                return final, part["text"]
    raise InvalidRequestError("continue_final_message needs a final message with text content to continue")


def _cut_at_marker(rendered: str, final_text: str) -> str:
    """`rendered` up to the end of the final message's text, where the marker is, so that what
    the template writes after it (the end of the turn) is left out; a template that strips the
    text's trailing whitespace (the marker's space with it) is cut after the stripped text."""
    marker = _CONTINUE_MARKER.strip()
    if final_text.strip() not in rendered or marker not in rendered:
        raise InvalidRequestError(
            "continue_final_message: the final message's text does not appear in the rendered chat "
            "(the chat template changes it), so there is nothing to continue"
        )
    at = rendered.rindex(marker)
    if rendered[at : at + len(_CONTINUE_MARKER)] == _CONTINUE_MARKER:  # the template kept the space
        return rendered[:at]
    return rendered[:at].rstrip()
