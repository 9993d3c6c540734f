"""What the client returns, and the mapping between Python keyword arguments and generation.proto."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from protos.defaults import INT32_MAX
from protos.tandem.v1 import generation_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}

# Keyword arguments of generate()/complete() and how each is checked before it is sent.
SAMPLING_FIELDS = {
    "max_tokens": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "seed": int,
    "stop": list,
    "stop_token_ids": list,
    "ignore_eos": bool,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "logprobs": int,
    "n": int,
    "min_tokens": int,
    "logit_bias": dict,
    "prompt_logprobs": int,
    "include_stop_str_in_output": bool,
    "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool,
    "truncate_prompt_tokens": int,
}

# The proto's integers: int32, but the seed's uint64, which takes a negative seed (vLLM's int64) as
# the offline SamplingParams does, modulo 2**64.
INT32_MIN = -(2**31)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _int32(value: int, what: str) -> int:
    """`value`, or ValueError naming `what` where an int32 field cannot hold it (protobuf's own
    error names only the value)."""
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"{what} must be in [{INT32_MIN}, {INT32_MAX}], got {value}")
    return value


class TandemError(Exception):
    """A failed call: the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> TandemError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely alternatives: (token id, logprob), best first.
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # The token's text and its alternatives' ("" from a server without a tokenizer).
    token: str = ""
    top_tokens: list[str] = field(default_factory=list)
    # A prompt token's rank in the vocabulary (1: the most likely); None for generated tokens.
    rank: int | None = None


@dataclass
class ToolCall:
    """A tool call of a chat answer, or a piece of one in a Chunk: the first piece of a call
    has its id and name, the others add to its arguments."""

    index: int
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Chunk:
    """New tokens of one sample of a request and the text they add (or the prompt's logprobs).
    For a chat prompt, `text` is the answer's content, without its reasoning and tool calls."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    # Which of the request's n samples.
    index: int = 0
    # The prompt's logprobs from its second token, in the chunks before the first token.
    prompt_logprobs: list[TokenLogprob] | None = None
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Final:
    """The last message of a sample: why it ended and how many tokens it counted."""

    finish_reason: str | None  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # The stop string (str) or stop token id (int) that ended the request; None otherwise.
    stop_reason: str | int | None
    request_id: str = ""
    index: int = 0


@dataclass
class Completion:
    """A whole generation (one sample), as complete() returns it."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    index: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    # A chat answer's reasoning (None when none came) and tool calls.
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_json(self) -> dict:
        """The CLI's JSON line: the same keys as the in-process `tandem generate --json`."""
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": usage_json(self.prompt_tokens, self.completion_tokens, self.cached_tokens),
        }


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """Token counts as OpenAI's `usage` names them."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "cached_tokens": cached_tokens,
    }


# A logprob of -inf (a token the model rules out) as JSON can carry it: the HTTP API's (vLLM's) -9999.0.
MIN_LOGPROB = -9999.0


def logprobs_json(logprobs: list) -> list[dict]:
    """Logprobs (the client's TokenLogprob or the offline LLM's) as the CLI's JSON prints them (-inf
    as MIN_LOGPROB: JSON has no infinity, and json.dumps would write -Infinity)."""
    out = []
    for lp in logprobs:
        tops = lp.top_tokens or [""] * len(lp.top_logprobs)
        entry = {
            "token_id": lp.token_id,
            "token": lp.token or "",
            "logprob": max(lp.logprob, MIN_LOGPROB),
            "top_logprobs": [
                {"token_id": t, "token": text, "logprob": max(v, MIN_LOGPROB)}
                for (t, v), text in zip(lp.top_logprobs, tops, strict=True)
            ],
        }
        if lp.rank is not None:
            entry["rank"] = lp.rank
        out.append(entry)
    return out


@dataclass
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    tensor_parallel_size: int
    dtype: str
    device: str
    # The most top logprobs a request may ask for (0 from a server that does not say).
    max_logprobs: int = 0


def sampling_params(**kwargs) -> pb.SamplingParams:
    """Build the proto SamplingParams; None leaves a field at the server's default."""
    unknown = set(kwargs) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling argument(s) {', '.join(sorted(unknown))}; "
            f"expected some of {', '.join(SAMPLING_FIELDS)}"
        )
    values = {}
    for name, value in kwargs.items():
        if value is None:
            continue
        kind = SAMPLING_FIELDS[name]
        if name == "stop" and isinstance(value, str):
            value = [value]
        if kind is dict:  # logit_bias: token id -> bias
            if not isinstance(value, dict):
                raise TypeError(f"{name} must be a dict of token id -> bias, got {value!r}")
            if any(isinstance(k, bool) or not isinstance(k, int) for k in value):
                raise TypeError(f"{name} keys must be token ids (integers), got {list(value)!r}")
            value = {_int32(int(k), f"{name} token id"): float(v) for k, v in value.items()}
        elif kind is list:
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise TypeError(f"{name} must be a list, got {value!r}")
            if name == "stop_token_ids":
                value = [_int32(int(v), f"{name}[{i}]") for i, v in enumerate(value)]
            else:
                value = [str(v) for v in value]
        elif kind is bool:
            value = bool(value)
        elif kind is int:
            if isinstance(value, bool) or int(value) != value:
                raise TypeError(f"{name} must be an integer, got {value!r}")
            value = int(value)
            if name != "seed":
                value = _int32(value, name)
            elif value == -1:  # vLLM's "no seed" (the offline SamplingParams' too): left unset
                continue
            elif SEED_MIN <= value <= SEED_MAX:
                value %= 2**64
            else:
                raise ValueError(f"seed must be in [-2**63, 2**64), got {value}")
            if name == "n" and value < 1:  # (the proto's 0 is unset: one sample)
                raise ValueError(f"n must be >= 1, got {value}")
        else:
            value = float(value)
        values[name] = value
    return pb.SamplingParams(**values)


def generate_request(
    prompt: str | list[int], request_id: str = "", *, user: str = "", **sampling
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        sampling_params=sampling_params(**sampling), request_id=request_id, user=user
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        ids = list(prompt)
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError("prompt must be a string or a list of token ids (ints)")
            _int32(t, f"prompt token id at position {i}")
        request.token_ids.ids.extend(ids)
    return request


# The keys of an OpenAI chat message that a ChatMessage carries.
CHAT_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def _chat_message(message: dict, i: int) -> dict:
    """An OpenAI-style message as ChatMessage fields: content as text (a list of text parts joined
    by newlines, as the HTTP API joins them), an assistant's tool calls as JSON. A key it cannot
    carry is refused rather than dropped, which would change the prompt unseen (a None is nothing)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise TypeError(f'messages[{i}] must be a dict with a "role" string, got {message!r:.100}')
    unknown = [k for k, v in message.items() if k not in CHAT_MESSAGE_KEYS and v is not None]
    if unknown:
        raise ValueError(
            f"messages[{i}] has {', '.join(map(repr, unknown))}, which a gRPC chat message cannot "
            f"carry (it takes {', '.join(CHAT_MESSAGE_KEYS)})"
        )
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise TypeError(
                    f'messages[{i}].content[{j}] must be a text part {{"type": "text", "text": ...}}'
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise TypeError(
            f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}"
        )
    fields = {"role": message["role"], "content": content or ""}
    if message.get("tool_calls"):
        fields["tool_calls_json"] = json.dumps(message["tool_calls"])
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise TypeError(f"messages[{i}].{key} must be a string, got {type(message[key]).__name__}")
            fields[key] = message[key]
    return fields


def chat_request(
    messages: list[dict],
    request_id: str = "",
    *,
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
    user: str = "",
    **sampling,
) -> pb.GenerateRequest:
    """A conversation ({"role", "content"} dicts) for the server to render with its chat template."""
    request = pb.GenerateRequest(
        sampling_params=sampling_params(**sampling), request_id=request_id, user=user
    )
    for i, message in enumerate(messages):
        request.chat.messages.add(**_chat_message(message, i))
    if chat_template_kwargs:
        request.chat.chat_template_kwargs_json = json.dumps(chat_template_kwargs)
    if tools:
        request.chat.tools_json = json.dumps(tools)
    if not messages:
        request.chat.SetInParent()
    return request


def _logprobs_from_proto(logprobs) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            lp.token_id,
            lp.logprob,
            [(t.token_id, t.logprob) for t in lp.top_logprobs],
            lp.token,
            [t.token for t in lp.top_logprobs],
            lp.rank or None,
        )
        for lp in logprobs
    ]


def chunk_from_proto(chunk: pb.GenerateChunk, index: int = 0) -> Chunk:
    logprobs = _logprobs_from_proto(chunk.logprobs) if len(chunk.logprobs) else None
    prompt_logprobs = _logprobs_from_proto(chunk.prompt_logprobs) if len(chunk.prompt_logprobs) else None
    calls = [ToolCall(c.index, c.id, c.name, c.arguments) for c in chunk.tool_calls]
    return Chunk(
        list(chunk.token_ids), chunk.text, logprobs, index, prompt_logprobs, chunk.reasoning_content, calls
    )


def final_from_proto(final: pb.GenerateFinal, request_id: str = "", index: int = 0) -> Final:
    return Final(
        finish_reason=FINISH_REASONS.get(final.finish_reason),
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        cached_tokens=final.cached_tokens,
        # A stop token id as an int, as the offline LLM and the HTTP API give it.
        stop_reason=final.stop_token_id if final.HasField("stop_token_id") else final.stop_reason or None,
        request_id=request_id,
        index=index,
    )


def item_from_response(response: pb.GenerateResponse, request_id: str = "") -> Chunk | Final | None:
    """A stream message as the client yields it (None for an empty payload)."""
    kind = response.WhichOneof("payload")
    if kind == "chunk":
        return chunk_from_proto(response.chunk, response.index)
    if kind == "final":
        return final_from_proto(response.final, response.request_id or request_id, response.index)
    return None


def model_info_from_proto(info: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model=info.model,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        tensor_parallel_size=info.tensor_parallel_size,
        dtype=info.dtype,
        device=info.device,
        max_logprobs=info.max_logprobs,
    )


class CompletionBuilder:
    """Accumulates a stream of chunks and its final message into a Completion."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.reasoning: list[str] | None = None
        self.tool_calls: dict[int, ToolCall] = {}
        self.final: Final | None = None

    def add(self, item: Chunk | Final) -> None:
        if isinstance(item, Final):
            self.final = item
            return
        self.text.append(item.text)
        if item.reasoning_content:
            self.reasoning = (self.reasoning or []) + [item.reasoning_content]
        for piece in item.tool_calls:
            call = self.tool_calls.get(piece.index)
            if call is None:
                self.tool_calls[piece.index] = ToolCall(piece.index, piece.id, piece.name, piece.arguments)
            else:
                call.arguments += piece.arguments
        self.token_ids.extend(item.token_ids)
        if item.logprobs is not None:
            self.logprobs = (self.logprobs or []) + item.logprobs
        if item.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or []) + item.prompt_logprobs

    def build(self) -> Completion:
        final = self.final
        return Completion(
            text="".join(self.text),
            token_ids=self.token_ids,
            finish_reason=final.finish_reason if final else None,
            prompt_tokens=final.prompt_tokens if final else 0,
            completion_tokens=final.completion_tokens if final else len(self.token_ids),
            cached_tokens=final.cached_tokens if final else 0,
            stop_reason=final.stop_reason if final else None,
            logprobs=self.logprobs,
            index=self.index,
            prompt_logprobs=self.prompt_logprobs,
            reasoning_content="".join(self.reasoning) if self.reasoning is not None else None,
            tool_calls=[self.tool_calls[i] for i in sorted(self.tool_calls)],
        )


class SamplesBuilder:
    """A CompletionBuilder per sample of a request (n), by the items' index."""

    def __init__(self) -> None:
        self.samples: dict[int, CompletionBuilder] = {}

    def add(self, item: Chunk | Final) -> None:
        builder = self.samples.get(item.index)
        if builder is None:
            builder = self.samples[item.index] = CompletionBuilder(item.index)
        builder.add(item)

    def build(self) -> list[Completion]:
        """The samples in index order; a sample's missing prompt logprobs are the first one's."""
        completions = [self.samples[i].build() for i in sorted(self.samples)]
        for c in completions[1:]:
            c.prompt_logprobs = c.prompt_logprobs or completions[0].prompt_logprobs
        return completions
