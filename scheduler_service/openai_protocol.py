"""The OpenAI API's request bodies and error objects, as the HTTP front end (http_api.py) reads and
writes them: bodies are validated strictly (a field of the wrong JSON type is refused, as OpenAI's
API refuses it), requests become tandem's SamplingParams through the same validation as gRPC's, and
errors become `{"error": {"message", "type", "param", "code"}}` with the status OpenAI (and vLLM)
use; a body that is no request gets a message saying what is wrong with it (body_error_message)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler_service.chat_template import ChatTemplate
from scheduler_service.errors import ErrorCode, InvalidRequestError
from scheduler_service.request_handling import verify_tools
from scheduler_service.sampling_params import SamplingParams, verify_unicode

# The most sequences (prompts x n) one completion may ask for: each is a request of its own in the
# engine, tokenized and admitted one after another on the event loop (200,000 prompts held it, and
# every stream and health check with it, for seconds). --max-queue's default: as many as could wait.
MAX_SEQUENCES_PER_REQUEST = 1024

HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}


# The errors a 400 for a malformed body lists (a list of a million wrong items has a million).
MAX_BODY_ERRORS = 10
_JSON_TYPES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def body_error_message(errors: Sequence[dict], body: Any, content_type: str | None) -> str:
    """The 400's message for a body that FastAPI could not read as the request: not JSON (where,
    and why), not sent as JSON (its Content-Type), empty, no JSON object, or its fields' errors,
    each with its path and, for a wrong type, the JSON type sent. `errors` are pydantic's (their
    paths start at "body"); `body` is the JSON text where it was not JSON, else what it parsed to.
    A field name with a lone surrogate (JSON can escape one) is an error of the whole body's."""
    first = errors[0] if errors else {"type": "missing", "loc": ("body",)}
    if first["type"] == "json_invalid" and isinstance(body, str):
        at = first["loc"][1]
        line = body.count("\n", 0, at) + 1
        column = at - body.rfind("\n", 0, at)
        return f"the request body is not valid JSON: {first['ctx']['error']} at line {line} column {column}"
    if tuple(first["loc"]) == ("body",):
        if first["type"] == "missing":
            return "the request body is empty: send a JSON object (Content-Type: application/json)"
        if first["type"] == "string_unicode":  # (the name of a field it does not know: read as text)
            return (
                f"the request body's field name {quoted(first['input'])} is not valid Unicode "
                "(surrogates not allowed)"
            )
        if isinstance(first.get("input"), bytes):  # (FastAPI reads JSON only when it says so)
            got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
            return f"the request body must be JSON, sent with Content-Type: application/json; got {got}"
        return f"the request body must be a JSON object, got {_json_type(first.get('input'))}"
    # A field of several shapes (a prompt: text, ids, a list of either) fails in each: the shape
    # whose error lies deepest is the one the client meant.
    depth: dict[tuple, int] = {}
    for error in errors:
        field = tuple(error["loc"][1:2])
        depth[field] = max(depth.get(field, 0), len(error["loc"]))
    errors = [error for error in errors if len(error["loc"]) == depth[tuple(error["loc"][1:2])]]
    messages = []
    for error in errors[:MAX_BODY_ERRORS]:
        message = f"{'.'.join(map(str, error['loc'][1:]))}: {error['msg']}"
        if error["type"].endswith("_type") and "input" in error:  # (a wrong JSON type)
            message += f", got {_json_type(error['input'])}"
        messages.append(message)
    if len(errors) > MAX_BODY_ERRORS:
        messages.append(f"and {len(errors) - MAX_BODY_ERRORS} more errors")
    return "; ".join(messages)


def unreadable_body_message(cause: BaseException | None) -> str:
    """The 400's message for a body that is not even JSON text: not UTF-8, nested too deeply for
    the parser, or a number it refuses (an integer of over 4,300 digits)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not UTF-8 JSON: {cause.reason} at byte {cause.start}"
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON: nested too deeply"
    if isinstance(cause, ValueError):  # (Python's advice after the ";" is for the server's code)
        return f"the request body is not valid JSON: {str(cause).split(';')[0]}"
    return "the request body could not be read as JSON"


# vLLM's fields asking for constrained output (structured outputs), which this server cannot honour:
# a 400 when given (not null), rather than free text where the client expects, say, JSON.
CONSTRAINED_OUTPUT_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structural_tag",
    "structured_outputs",
)


# vLLM's sampling features this server does not have, with the values that ask for nothing: another
# value is a 400 naming the field, rather than output the client did not ask for (a token it banned,
# a word it forbade) without a word. (vLLM itself refuses logits_processors, and a priority other
# than 0, unless configured for them.)
UNSUPPORTED_SAMPLING_FIELDS = {
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "use_beam_search": (None, False),
    "logits_processors": (None,),
    "priority": (None, 0),
}


_T = TypeVar("_T")
# A list whose validation stops at its first wrong item: pydantic reports each wrong item by default,
# so a long list of them (a million token ids with one string among them, tried against each of
# the prompt's shapes) took seconds of the event loop and answered with a 100 MB message.
FailFastList = Annotated[list[_T], Field(fail_fast=True)]


# Request bodies are read strictly, as OpenAI's API reads them: a field of the wrong JSON type is a
# 400 naming it ("max_tokens": "12", 12.0 or true is no integer; "stream": "yes" or 1 no boolean;
# "temperature": "0.5" no number). An integer is a number (JSON has one kind), and null stays the
# default where a field allows it. (The offline LLM builds a ChatRequest from Python values: not
# strict there.)
_STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    """vLLM's: `{}` includes the usage (a last chunk with it), and continuous_usage_stats (with
    include_usage) puts the usage so far in every chunk too."""

    model_config = _STRICT

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Request(BaseModel):
    """What completions and chat completions share (OpenAI's fields, then vLLM's extras)."""

    # Fields not declared here are kept (model_extra) to be named: ignored_fields().
    model_config = ConfigDict(_STRICT, extra="allow")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | FailFastList[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: FailFastList[int] = Field(default_factory=list)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's: the prompt's token ids and each choice's generated ids beside the text (streamed: the
    # prompt's in a choice's first chunk, each chunk's own ids in it).
    return_token_ids: bool | None = None

    # The fields a client may send as null for their default: OpenAI's nullable ones and vLLM's
    # optional ones. (Where None is a value of its own, as max_tokens' "no limit", the field says so.)
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset(
        {
            "n",
            "stream",
            "presence_penalty",
            "frequency_penalty",
            "min_p",
            "repetition_penalty",
            "stop_token_ids",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        }
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.NULL_IS_DEFAULT}
        return data

    def check_fields(self) -> None:
        """Raises InvalidRequestError for fields that contradict each other, or ask for what this
        server cannot do (before any work)."""
        # (vLLM's test: options sent as {} or null are no options)
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise InvalidRequestError("Stream options can only be defined when `stream=True`.")
        if self.user is not None:  # (logged, and sent to the engine core by API server processes)
            verify_unicode(self.user, "user")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidRequestError(
                f"response_format type {self.response_format.get('type')!r} is not supported: this "
                'server generates free text only (response_format {"type": "text"})'
            )
        extra = self.model_extra or {}
        for name in CONSTRAINED_OUTPUT_FIELDS:
            if extra.get(name) is not None:
                raise InvalidRequestError(
                    f"{name} is not supported: this server generates free text only (no structured outputs)"
                )
        for name, defaults in UNSUPPORTED_SAMPLING_FIELDS.items():
            if name in extra and not any(extra[name] == d and type(extra[name]) is type(d) for d in defaults):
                raise InvalidRequestError(f"{name} is not supported by this server")

    def ignored_fields(self) -> list[str]:
        """The fields sent (other than as null) that this server does not know, so does not act on."""
        return sorted(name for name, value in (self.model_extra or {}).items() if value is not None)

    def max_tokens_of(self) -> int | None:
        return self.max_tokens

    def prompt_logprobs_of(self) -> int | None:
        """The alternatives per prompt token the engine scores the prompt with (None: not scored)."""
        return self.prompt_logprobs

    def as_sent(self, message: str) -> str:
        """An error message with the fields named as the client sent them."""
        return message

    def sampling_params(self, num_logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError naming the limit."""
        max_tokens = self.max_tokens_of()
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=0 if self.top_k is None else self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=num_logprobs,
            n=self.n,
            min_tokens=self.min_tokens,
            logit_bias=_logit_bias(self.logit_bias),
            prompt_logprobs=self.prompt_logprobs_of(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


# A logit_bias key: a token id in plain decimal ASCII digits. (Python's int() also takes "5_0",
# " 7 " and other scripts' digits.) A minus sign is read, for SamplingParams to refuse as no id.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")
# More digits than any token id has (and int() takes at most 4,300).
_MAX_TOKEN_ID_DIGITS = 20


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: JSON object keys are token ids as strings."""
    out = {}
    for key, value in (bias or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise InvalidRequestError(
                f'logit_bias keys must be token ids in decimal digits (as "42"), got {quoted(key)}'
            )
        if len(key.lstrip("-0")) > _MAX_TOKEN_ID_DIGITS:
            raise InvalidRequestError(f"logit_bias key {quoted(key)} is outside the vocabulary")
        out[int(key)] = value
    return out


def quoted(text: str, limit: int = 64) -> str:
    """`text` as an error message quotes it: repr, cut short."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def check_tool_calls(calls: Any, where: str) -> None:
    """An assistant's past tool calls as OpenAI's: a list of {"function": {"name", "arguments"}},
    arguments JSON text (or an object, as transformers takes them); InvalidRequestError naming the
    first that is not (a template failed on it naming neither, or wrote it as Python does)."""
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list of tool calls, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidRequestError(
                f'{where}[{j}] must be a tool call: {{"function": {{"name": ..., "arguments": ...}}}}'
            )
        if not isinstance(name := function.get("name"), str):
            raise InvalidRequestError(
                f"{where}[{j}].function.name must be a string, got {type(name).__name__}"
            )
        if not isinstance(arguments := function.get("arguments"), (str, dict, type(None))):
            raise InvalidRequestError(
                f"{where}[{j}].function.arguments must be a string (JSON) or an object, got "
                f"{type(arguments).__name__}"
            )


def calls_for_template(calls: list) -> list:
    """An assistant's past tool calls as chat templates take them (transformers' convention, and
    vLLM's): each call's `arguments` an object, not OpenAI's JSON string of it ({} for none).
    Arguments that are no JSON object stay as sent: the model's own text, which a template that
    writes a string as it is (Qwen3's) writes back unchanged."""
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            if not arguments:
                arguments = {}
            elif isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except (ValueError, RecursionError):  # not JSON, an integer too long, nested too deep
                    parsed = None
                if isinstance(parsed, dict):
                    arguments = parsed
            call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


class CompletionRequest(_Request):
    prompt: str | FailFastList[str] | FailFastList[int] | FailFastList[FailFastList[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt, as Hugging Face adds them.
    add_special_tokens: bool = True

    NULL_IS_DEFAULT = _Request.NULL_IS_DEFAULT | {"echo"}

    def prompts(self) -> list[str | list[int]]:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (other than equal to n)")
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        if len(prompt) * self.n > MAX_SEQUENCES_PER_REQUEST:  # (before any is tokenized)
            raise InvalidRequestError(
                f"prompt is a list of {len(prompt)} prompts, x n ({self.n}) = {len(prompt) * self.n} "
                f"sequences; a request generates at most {MAX_SEQUENCES_PER_REQUEST}: send fewer prompts "
                "per request"
            )
        return list(prompt)

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 (OpenAI's and vLLM's): the prompt comes back alone (scored, with
        logprobs), nothing generated. The engine generates at least one token: it samples one,
        which is not returned (as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def max_tokens_of(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    def prompt_logprobs_of(self) -> int | None:
        """Echoed with logprobs, the prompt's tokens come with theirs: the prompt is scored with at
        least `logprobs` alternatives per token (vLLM's)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def sampling_params(self, num_logprobs: int | None) -> SamplingParams:
        if self.prompt_only and self.min_tokens > 0:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens (0)")
        return super().sampling_params(num_logprobs)

    def as_sent(self, message: str) -> str:
        """The length limit of a prompt echoed with max_tokens 0 counts the one token it samples."""
        if self.prompt_only:
            message = message.replace(
                "+ max_tokens (1) exceeds",
                "+ 1 token (echo with max_tokens 0 still samples one, not returned) exceeds",
            )
        return message

    @property
    def num_top_logprobs(self) -> int:
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequestError(f"logprobs must be >= 0, got {self.logprobs}")
        return self.logprobs or 0


class ChatRequest(_Request):
    messages: FailFastList[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: FailFastList[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's: the prompt ends inside the final message (an assistant's start), which the model continues.
    continue_final_message: bool = False
    documents: FailFastList[dict[str, Any]] | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) on top of what the template writes (off: the
    # template writes its own).
    add_special_tokens: bool = False

    NULL_IS_DEFAULT = _Request.NULL_IS_DEFAULT | {"logprobs"}

    def check_fields(self) -> None:
        super().check_fields()
        if (self.model_extra or {}).get("echo"):  # (rather than ignored: the client expects its prompt back)
            raise InvalidRequestError(
                "echo is not supported in chat completions (a completion echoes its prompt: /v1/completions)"
            )
        if self.stream and self.prompt_logprobs:  # (vLLM's rule: 0 is taken, and none come)
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream=true in a chat completion: they come "
                "in the whole response (or stream a completion: its first chunk carries them)"
            )
        # A template sent with the request would run the caller's Jinja on the server: refused, as
        # vLLM refuses it by default, rather than ignored (the prompt would not be the one asked for).
        if (self.model_extra or {}).get("chat_template") is not None or (
            isinstance(self.chat_template_kwargs, dict)
            and self.chat_template_kwargs.get("chat_template") is not None
        ):
            raise InvalidRequestError(
                "chat_template in a request is not supported: this server renders every chat with the "
                "model's own template (its tokenizer_config.json or chat_template.jinja)"
            )

    def render(self, template: ChatTemplate) -> str:
        """The prompt `template` writes for these messages, tools, documents and template kwargs."""
        verify_tools(self.tools, "tools")
        return template.render(
            self.template_messages(),
            tools=self.tools,
            documents=self.documents,
            add_generation_prompt=self.add_generation_prompt,
            chat_template_kwargs=self.chat_template_kwargs,
            continue_final_message=self.continue_final_message,
        )

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them: text parts joined into one string, and a null
        or absent content as "" (vLLM's: a template that concatenates it, as Mistral's and Llama's
        do, failed on None or wrote "None")."""
        messages = []
        for i, message in enumerate(self.messages):
            if "role" not in message:
                raise InvalidRequestError(f"messages[{i}] has no role")
            if not isinstance(message["role"], str):
                raise InvalidRequestError(
                    f"messages[{i}].role must be a string, got {type(message['role']).__name__}"
                )
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):  # (OpenAI's types)
                raise InvalidRequestError(
                    f"messages[{i}].content must be a string or a list of content parts, got "
                    f"{type(content).__name__}"
                )
            if content is None:
                message = {**message, "content": ""}
            elif isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text":
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise InvalidRequestError(
                            f"messages[{i}]: content parts of type {kind!r} are not supported"
                        )
                    if not isinstance(text := part.get("text"), str):
                        raise InvalidRequestError(
                            f"messages[{i}].content[{j}].text must be a string, got {type(text).__name__}"
                        )
                    texts.append(text)
                message = {**message, "content": "\n".join(texts)}
            if message["role"] == "assistant" and "tool_calls" in message:
                calls = message["tool_calls"]
                if calls is not None:
                    check_tool_calls(calls, f"messages[{i}].tool_calls")
                message = {**message, "tool_calls": calls_for_template(calls or [])}
                if not calls:  # (a template asking `'tool_calls' in message` takes null or [] for calls)
                    del message["tool_calls"]
            messages.append(message)
        if not messages:
            raise InvalidRequestError("messages is empty")
        return messages

    def parses_tools(self) -> bool:
        if self.tool_choice == "required" and self.tools == []:  # (vLLM's and OpenAI's: as "none")
            return False
        if self.tool_choice not in (None, "none") and self.tools is None:  # (vLLM's rule)
            raise InvalidRequestError("When using `tool_choice`, `tools` must be set.")
        if isinstance(self.tool_choice, dict) or self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError('tool_choice: only "auto" and "none" are supported')
        return bool(self.tools) and self.tool_choice != "none"

    def prompt_logprobs_of(self) -> int | None:
        """A stream has no place for them (vLLM's takes prompt_logprobs 0 there and sends none):
        the prompt is not scored."""
        if self.stream and self.prompt_logprobs == 0:
            return None
        return self.prompt_logprobs

    def max_tokens_of(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) or max_tokens; both must agree if given."""
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequestError(
                f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                "differ: give one of them"
            )
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def as_sent(self, message: str) -> str:
        """The limit is max_completion_tokens where the client sent only that name, and the number of
        alternatives (the engine's logprobs) is top_logprobs where it sent them."""
        if self.max_completion_tokens is not None and self.max_tokens is None:
            message = re.sub(r"\bmax_tokens\b", "max_completion_tokens", message)
        if self.top_logprobs is not None:
            message = re.sub(r"^logprobs \(", "top_logprobs (", message)
        return message

    @property
    def num_top_logprobs(self) -> int:
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise InvalidRequestError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:  # (0, the default, asks for nothing: vLLM's)
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        return self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages (with the chat fields that shape the prompt)."""

    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    messages: FailFastList[dict[str, Any]] | None = None
    # Default: on for a prompt, off for messages (the template writes its own), as vLLM's.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: FailFastList[dict[str, Any]] | None = None
    documents: FailFastList[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: refused, as a chat completion refuses it (it was ignored: the ids were another template's).
    chat_template: str | None = None

    def chat(self) -> ChatRequest | None:
        """The messages as a chat completion's (None for a prompt); InvalidRequestError for neither
        or both, or for what a chat completion refuses of them (ChatRequest.check_fields)."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send a prompt or messages (one of them)")
        if self.messages is None:
            return None
        fields = (
            "messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
            "chat_template_kwargs", "chat_template",
        )  # fmt: skip
        chat = ChatRequest(**{name: getattr(self, name) for name in fields})
        chat.check_fields()
        return chat


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    tokens: FailFastList[int]
