"""Request handling without a transport: what every front end does to a request, written once.

The gRPC servicer (generation_service.py), the offline `LLM` (client/llm.py) and an HTTP front
end call these, so that a request behaves the same whichever way it came:

- validation: `SamplingParams.verify` (finite numbers, ranges, stop strings' count and length),
  `verify_request_id`, and the engine's checks against the executor's limits (`verify_request`);
- tokenization: `check_text_prompt` refuses a text prompt whose size alone shows it cannot fit,
  before the work, and `tokenize` encodes it;
- output: an `OutputProcessor` per request turns generated token ids into text deltas that are
  final (incremental detokenization), ends the output at the first stop string (the caller then
  aborts the request in its engine) and names the finish reason and stop reason; `name_tokens`
  gives logprobs their tokens' text.

Errors are `TandemRequestError` (errors.py); only a transport maps their codes to its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_service.chat_template import ChatTemplate
from scheduler_service.detokenizer import IncrementalDetokenizer, prompt_context
from scheduler_service.errors import InvalidRequestError
from scheduler_service.sampling_params import (
    SamplingParams,
    truncated_length,
    verify_prompt_length,
    verify_unicode,
)
from scheduler_service.sequence import TokenLogprob
from scheduler_service.tokenizer import Tokenizer

FINISH_REASONS = ("stop", "length", "abort")
NO_TOKENIZER = "this server has no tokenizer: send token ids or start it with --tokenizer"
# It is echoed in every response.
MAX_REQUEST_ID_CHARS = 256
# Text prompts longer than this are worth tokenizing off an event loop.
TOKENIZE_INLINE_CHARS = 8192
# Chats of more messages than this are rendered off an event loop: a chat template is Jinja, some
# microseconds a message, and a 16 MiB gRPC request holds 3M messages.
RENDER_INLINE_MESSAGES = 256


def verify_request_id(request_id: str) -> None:
    """A client's request id is logged as it is: at most MAX_REQUEST_ID_CHARS printable characters (a
    newline in one would write a line of its own choosing into the scheduler's log)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id is {len(request_id)} characters long; at most {MAX_REQUEST_ID_CHARS}"
        )
    if not request_id.isprintable():
        at = next(i for i, c in enumerate(request_id) if not c.isprintable())
        raise InvalidRequestError(
            f"request_id has a character that is not printable ({request_id[at]!r}) at position {at}"
        )


def verify_tools(tools: list | None, name: str) -> None:
    """OpenAI's function tools, as vLLM takes them: `{"type": "function", "function": {"name": ...,
    "parameters": {...}}}` (type may be left out). A chat template writes whatever it is given, so a
    tool of another shape would reach the model as a definition of nothing."""
    for i, tool in enumerate(tools or ()):
        if (kind := tool.get("type", "function")) != "function":
            raise InvalidRequestError(f'{name}[{i}].type must be "function", got {kind!r:.64}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(
                f'{name}[{i}].function must be an object: {{"name": ..., "parameters": {{...}}}}, got '
                f"{type(function).__name__}"
            )
        if not isinstance(function.get("name"), str):
            raise InvalidRequestError(
                f"{name}[{i}].function.name must be a string, got {type(function.get('name')).__name__}"
            )
        if not isinstance(function.get("parameters", {}), (dict, type(None))):
            raise InvalidRequestError(
                f"{name}[{i}].function.parameters must be an object, got "
                f"{type(function['parameters']).__name__}"
            )


def verify_tokenizer(params: SamplingParams, tokenizer: Tokenizer | None, no_tokenizer: str) -> None:
    """Stop strings are matched on the text: they need a tokenizer."""
    if params.stop and tokenizer is None:
        raise InvalidRequestError(f"stop strings need a tokenizer; {no_tokenizer}")


def check_text_prompt(
    tokenizer: Tokenizer | None,
    text: str,
    params: SamplingParams,
    max_model_len: int,
    no_tokenizer: str = NO_TOKENIZER,
) -> Tokenizer:
    """The tokenizer to encode `text` with; raises InvalidRequestError without one, for a text that
    is not Unicode, or when the text is too long to fit even at the most bytes a token can hold
    (checked without tokenizing; with truncate_prompt_tokens, what it keeps of that)."""
    if tokenizer is None:
        raise InvalidRequestError(no_tokenizer)
    at_least = tokenizer.min_num_tokens(text)
    if (keep := truncated_length(params, max_model_len)) is not None:
        at_least = min(at_least, keep)
    verify_prompt_length(at_least, params, max_model_len, lower_bound=True)
    verify_unicode(text, "the prompt")
    return tokenizer


async def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """text's token ids; a text longer than TOKENIZE_INLINE_CHARS is encoded in a thread, off the GIL
    (encode_off_gil), so that the event loop (health, other streams) runs meanwhile."""
    if len(text) > TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(tokenizer.encode_off_gil, text, add_special_tokens)
    return tokenizer.encode(text, add_special_tokens)


def tokenize(
    tokenizer: Tokenizer | None,
    text: str,
    params: SamplingParams,
    max_model_len: int,
    no_tokenizer: str = NO_TOKENIZER,
    add_special_tokens: bool = True,
) -> list[int]:
    """The prompt's token ids, after check_text_prompt (without special tokens for a prompt a chat
    template rendered: it writes its own)."""
    tokenizer = check_text_prompt(tokenizer, text, params, max_model_len, no_tokenizer)
    return tokenizer.encode(text, add_special_tokens)


def chat_template(tokenizer: Tokenizer | None, no_tokenizer: str = NO_TOKENIZER) -> ChatTemplate:
    """The template that renders chat messages into a prompt; InvalidRequestError without one.
    The rendered text is tokenized without special tokens (the template writes its own), as
    transformers' apply_chat_template."""
    if tokenizer is None:
        raise InvalidRequestError(no_tokenizer)
    template = tokenizer.chat_template
    if template is None:
        raise InvalidRequestError(
            "this model has no chat template (chat_template.jinja, or chat_template in "
            "tokenizer_config.json, beside its tokenizer.json): send a text prompt"
        )
    return template


def name_tokens(tokenizer: Tokenizer | None, logprobs: Sequence[TokenLogprob]) -> None:
    """Fill in each entry's token text (and its alternatives'), when there is a tokenizer."""
    if tokenizer is None:
        return
    text = tokenizer.token_text
    for lp in logprobs:
        lp.token = text(lp.token_id)
        lp.top_tokens = [text(t) for t, _ in lp.top_logprobs]


@dataclass(slots=True)
class OutputDelta:
    # Final text: never a broken UTF-8 tail, never a possible start of a stop string.
    text: str
    # How many of the token ids passed to add() belong to the output (fewer when a stop string
    # completed inside the batch: the output ends at the token that completed it).
    num_tokens: int
    stopped: bool


class OutputProcessor:
    """One request's output on its way to the user. Feed each batch of generated ids to add()
    (with `finished` and the engine's finish reason on the last one); once `stop_string` is set,
    abort the request in the engine and send nothing more.

    A stop token's text (an end-of-sequence token, or one of stop_token_ids) is left out of the
    text, as vLLM does, unless include_stop_str_in_output; its id stays in the output. The text is
    decoded as the prompt's continuation (`prompt_token_ids`: prompt_context)."""

    def __init__(
        self, tokenizer: Tokenizer | None, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self.params = params
        self._detokenizer = (
            IncrementalDetokenizer(
                tokenizer,
                params.stop,
                params.include_stop_str_in_output,
                params.min_tokens,
                prompt_context(tokenizer, prompt_token_ids, params.skip_special_tokens),
                params.skip_special_tokens,
            )
            if tokenizer is not None
            else None
        )
        self.stop_string: str | None = None
        self.num_tokens = 0

    def add(self, token_ids: Sequence[int], finished: bool, engine_reason: str | None = None) -> OutputDelta:
        detokenizer = self._detokenizer
        if detokenizer is None:
            self.num_tokens += len(token_ids)
            return OutputDelta("", len(token_ids), False)
        # The engine's "stop" is a stop token, the last id.
        drop_stop_token = (
            finished
            and engine_reason == "stop"
            and len(token_ids) > 0
            and not self.params.include_stop_str_in_output
        )
        update = detokenizer.add(token_ids[:-1] if drop_stop_token else token_ids)
        text = update.text
        num_tokens = update.num_tokens
        if update.stop_string is not None:
            self.stop_string = update.stop_string
        else:
            num_tokens = len(token_ids)
            if finished:
                text += detokenizer.flush()
        self.num_tokens += num_tokens
        return OutputDelta(text, num_tokens, update.stop_string is not None)

    def finish(self, engine_reason: str | None, last_token_id: int | None) -> tuple[str, str | int | None]:
        """(finish reason, stop reason) of the request: finish_reasons() with the stop string that
        ended it, if one did."""
        return finish_reasons(self.params, engine_reason, last_token_id, self.stop_string)


def finish_reasons(
    params: SamplingParams,
    engine_reason: str | None,
    last_token_id: int | None,
    stop_string: str | None = None,
) -> tuple[str, str | int | None]:
    """(finish reason, stop reason) of a finished request, for a stream (OutputProcessor.finish) and
    for the offline LLM's whole outputs alike: "stop" with the stop string (a str) or the stop
    token id (an int) that ended it, as vLLM's stop_reason, else None; "length", or "abort" (also
    for a request that ended without a reason)."""
    if stop_string is not None:
        return "stop", stop_string
    reason = engine_reason or "abort"
    if reason == "stop" and last_token_id in params.stop_token_ids:
        return reason, last_token_id
    return reason, None
