"""The OpenAI-compatible HTTP front end (FastAPI on uvicorn, on the scheduler's event loop):
GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON, or SSE with `data: [DONE]`),
vLLM's POST /tokenize and /detokenize, GET /health (and vLLM's /ping) and vLLM's GET /version.
Requests go through the same transport-free layer as gRPC's (request_handling.py) and the same
AsyncEngine; errors are OpenAI error objects (openai_protocol.py). A client that goes away aborts
its requests, which frees their blocks. A request body is at most MAX_BODY_BYTES (the gRPC API's
message limit): a larger one is a 413 before it is parsed."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from protos.api_keys import AUTHORIZATION, ApiKeys
from protos.defaults import GENERATION_MAX_MESSAGE_BYTES
from scheduler_service.async_engine import AsyncEngine
from scheduler_service.chat_output import ChatDelta, ChatOutputParser
from scheduler_service.config import SchedulerLimits
from scheduler_service.errors import ErrorCode, InvalidRequestError, TandemRequestError
from scheduler_service.openai_protocol import (
    HTTP_STATUS,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    body_error_message,
    error_body,
    quoted,
    unreadable_body_message,
)
from scheduler_service.request_handling import (
    RENDER_INLINE_MESSAGES,
    TOKENIZE_INLINE_CHARS,
    OutputProcessor,
    chat_template,
    check_text_prompt,
    encode_text,
    verify_tokenizer,
)
from scheduler_service.request_stream import RequestStream
from scheduler_service.sampling_params import (
    SamplingParams,
    escape_surrogates,
    truncate_prompt,
    verify_prompt_length,
    verify_token_ids,
    verify_unicode,
)
from scheduler_service.sequence import TokenLogprob
from scheduler_service.tool_call_formats import (
    AUTO,
    DEFAULT,
    check_tool_call_parser,
    keeps_special_tokens,
    tool_call_format,
)

logger = logging.getLogger(__name__)

try:  # (/version's answer)
    _VERSION = importlib.metadata.version("tandem")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
    _VERSION = "unknown"

TIMEOUT_HEADER = "x-request-timeout"  # seconds; past it: 504
# The endpoints whose refusals count in tandem_scheduler_requests_failed_total.
_REQUEST_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Endpoints outside /v1 that need the API key too (vLLM's: the tokenizer and the chat template).
_TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})
NO_TOKENIZER = "this server has no tokenizer: send token ids or start the scheduler with --tokenizer"
# The largest request body, the gRPC API's message limit: what one API takes, the other does. FastAPI
# reads a body whole and parses it on the event loop, which every stream and health check shares.
MAX_BODY_BYTES = GENERATION_MAX_MESSAGE_BYTES


# How verify_prompt_length's refusals name the model's limit (they cross the engine's IPC as text).
_CONTEXT_LIMIT = re.compile(r"(?:exceeds|to generate within) max_model_len \((\d+)\)")

# The least logprob an answer writes (vLLM's): -inf is no JSON number.
MIN_LOGPROB = -9999.0

# The most names of ignored request fields one warning lists.
MAX_LOGGED_FIELDS = 20


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    # A message may quote the request, and JSON text may hold a lone surrogate ("\\ud800"): written
    # escaped, not as a 500.
    return JSONResponse(error_body(escape_surrogates(message), status, code=code), status_code=status)


@dataclass
class _Choice:
    """One generated sequence on its way out: its stream, its detokenizer and parsers."""

    index: int
    stream: RequestStream
    output: OutputProcessor
    # A chat answer's reasoning and tool calls (None: all of it is content).
    parser: ChatOutputParser | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id (of stop_token_ids) that ended it, else None.
    stop_reason: str | int | None = None
    sent_prompt_logprobs: bool = False
    # A completion's echoed prompt: its text, and its first token (which has no logprob).
    prompt_text: str | None = None
    first_prompt_token: int | None = None
    # Echoed with max_tokens 0: the one token the engine samples is not returned.
    prompt_only: bool = False
    # The prompt's token ids (as submitted: truncated, if asked) and the generated ids returned.
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    sent_prompt_token_ids: bool = False

    @property
    def num_tokens(self) -> int:
        """The generated tokens returned."""
        return 0 if self.prompt_only else self.output.num_tokens

    def split(self, text: str, last: bool) -> ChatDelta:
        return self.parser.add(text, last) if self.parser is not None else ChatDelta(content=text)


class OpenAIServer:
    def __init__(
        self,
        engine: AsyncEngine,
        api_keys: list[str] | None = None,
        stream_interval: int = 1,
        allowed_origins: list[str] | None = None,
        tool_call_parser: str = AUTO,
    ) -> None:
        """`stream_interval`: the fewest tokens a streamed chunk carries, except a choice's last
        (--stream-interval, as on the gRPC API); `allowed_origins`: browser origins answered
        cross-origin (CORS, --allowed-origins; none: no CORS headers, browsers refuse other pages);
        `tool_call_parser`: the format tool calls are read in (--tool-call-parser; "auto": the
        checkpoint's, tool_call_formats.py)."""
        self.engine = engine
        self.stream_interval = stream_interval
        self.allowed_origins = list(allowed_origins or [])
        self.tool_call_parser = check_tool_call_parser(tool_call_parser)
        self.metrics = engine.metrics
        self._keys = ApiKeys(api_keys) if api_keys else None
        self.app = self._build_app()

    # -- the app ----------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(_LimitBody, server=self, limit=MAX_BODY_BYTES)
        if self._keys is not None:  # (outermost: a caller without a key learns nothing of its body)
            app.add_middleware(_RequireApiKey, server=self)
        if self.allowed_origins:
            # Outside the key check: a browser's preflight (OPTIONS) carries no key, and a refusal
            # (401) still needs the headers for the page to read it. No credentials (cookies): the
            # API's key is a header.
            app.add_middleware(
                CORSMiddleware, allow_origins=self.allowed_origins, allow_methods=["*"], allow_headers=["*"]
            )

        @app.exception_handler(HttpError)
        async def http_error(request: Request, e: HttpError) -> JSONResponse:
            return _error_response(e.status, e.message, e.code)

        # An unknown route or method; a body too large, or that FastAPI could not parse (not UTF-8,
        # nested too deeply: its own 400 without the reason, which is the exception's cause).
        @app.exception_handler(StarletteHTTPException)
        async def http_exception(request: Request, e: StarletteHTTPException) -> JSONResponse:
            if e.status_code == 413:
                self.count_too_large(request.url.path)
            if e.status_code == 400 and e.__cause__ is not None:
                self.count_invalid_body(request.url.path)
                return _error_response(400, unreadable_body_message(e.__cause__))
            return JSONResponse(error_body(str(e.detail), e.status_code), e.status_code, e.headers)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
            self.count_invalid_body(request.url.path)
            content_type = request.headers.get("content-type")
            return _error_response(400, body_error_message(e.errors(), e.body, content_type))

        # HEAD as well as GET, as load balancers' probes send (FastAPI's get() answers HEAD 405);
        # /ping is vLLM's (SageMaker's) name for it, which SageMaker may also POST.
        @app.api_route("/health", methods=["GET", "HEAD"])
        @app.api_route("/ping", methods=["GET", "HEAD", "POST"])
        async def health() -> JSONResponse:
            try:
                self.engine.check_admitting()
            except TandemRequestError as e:
                return _error_response(503, e.message)
            return JSONResponse({"status": "ok"})

        @app.api_route("/version", methods=["GET", "HEAD"])
        async def version() -> JSONResponse:  # (vLLM's: the server's version, no key needed)
            return JSONResponse({"version": _VERSION})

        def model_card(engine) -> dict:
            """vLLM's model card: OpenAI's fields, then root (what the model was loaded from: this
            server names it as the executor does), parent (a LoRA's base: none here), max_model_len
            and one permission."""
            created = int(time.time())
            return {
                "id": engine.info.model,
                "object": "model",
                "created": created,
                "owned_by": "tandem",
                "root": engine.info.model,
                "parent": None,
                "max_model_len": engine.limits.max_model_len,
                "permission": [_model_permission(created)],
            }

        @app.api_route("/v1/models", methods=["GET", "HEAD"])
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [model_card(self._engine())]})

        # OpenAI's retrieve (client.models.retrieve): the served model's card, else a 404. Hub ids
        # have a slash, so the id is the rest of the path.
        @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
        async def model(model_id: str) -> JSONResponse:
            engine = self._engine()
            # (an empty id names no model: a 404 too, where a body without `model` means the served one)
            if (unknown := self._unknown_model(model_id or "''", engine.info.model)) is not None:
                raise unknown
            return JSONResponse(model_card(engine))

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self._serve(request, body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatRequest, request: Request):
            return await self._serve(request, body, chat=True)

        @app.post("/tokenize")
        async def tokenize(body: TokenizeRequest) -> JSONResponse:
            return await self._tokenize(body)

        @app.post("/detokenize")
        async def detokenize(body: DetokenizeRequest) -> JSONResponse:
            return await self._detokenize(body)

        return app

    def _refuse_unauthorized(self, headers: Headers) -> JSONResponse | None:
        """The 401 for a request without a valid key (None: authorized)."""
        header = headers.get(AUTHORIZATION)
        if self._keys is None or self._keys.authorized([(AUTHORIZATION, header or "")]):
            return None
        self.metrics.requests_failed.labels("UNAUTHENTICATED").inc()
        return _error_response(
            401,
            "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            "invalid_api_key",
        )

    def count_invalid_body(self, path: str) -> None:
        """A completion refused for its body (not JSON, a bad field) counts as gRPC counts a message
        it cannot take."""
        if path in _REQUEST_PATHS:
            self.metrics.requests_failed.labels(ErrorCode.INVALID_ARGUMENT.name).inc()

    def count_too_large(self, path: str) -> None:
        """A completion refused for its body's size counts as gRPC counts an oversized message."""
        if path in _REQUEST_PATHS:
            self.metrics.requests_failed.labels(ErrorCode.RESOURCE_EXHAUSTED.name).inc()

    def _engine(self):
        try:
            return self.engine.check_admitting()
        except TandemRequestError as e:
            raise HttpError(HTTP_STATUS[e.code], e.message) from None

    @staticmethod
    def _unknown_model(name: str | None, served: str) -> HttpError | None:
        """The 404 for a model this server does not serve (None: it serves it, or none was named).
        The executor names a local checkpoint by its directory: its path names it too."""
        if name and name != served and Path(name).name != served:
            return HttpError(
                404,
                f"the model {quoted(name)} does not exist: this server serves {served!r}",
                "model_not_found",
            )
        return None

    def _fail(self, e: TandemRequestError) -> HttpError:
        self.metrics.requests_failed.labels(e.code.name).inc()
        return HttpError(HTTP_STATUS[e.code], *_client_message(e))

    # -- admission --------------------------------------------------------------------------

    async def _encode(self, text: str, params: SamplingParams, add_special_tokens: bool) -> list[int]:
        engine = self.engine.check_admitting()
        tokenizer = check_text_prompt(
            self.engine.tokenizer, text, params, engine.limits.max_model_len, NO_TOKENIZER
        )
        return await encode_text(tokenizer, text, add_special_tokens)

    async def _prompts(
        self, body: CompletionRequest | ChatRequest, chat: bool
    ) -> tuple[list[str | list[int]], Any]:
        """The prompts, and the template when `chat`."""
        if not chat:
            return body.prompts(), None
        template = chat_template(self.engine.tokenizer, NO_TOKENIZER)

        if len(body.messages) > RENDER_INLINE_MESSAGES:  # (the event loop runs meanwhile)
            return [await asyncio.to_thread(body.render, template)], template
        return [body.render(template)], template

    async def _admit(self, body, chat: bool, timeout: float | None) -> tuple[list[_Choice], str]:
        body.check_fields()
        engine = self.engine.check_admitting()  # (a refusal is counted, as gRPC counts it: _serve)
        if (unknown := self._unknown_model(body.model, engine.info.model)) is not None:
            self.metrics.requests_failed.labels("NOT_FOUND").inc()
            raise unknown
        num_top = body.num_top_logprobs
        wants_logprobs = body.logprobs if chat else body.logprobs is not None
        # (0 alternatives: each token's own logprob, as vLLM's; None: no logprobs at all)
        params = body.sampling_params(num_top if wants_logprobs else None)
        verify_tokenizer(params, self.engine.tokenizer, NO_TOKENIZER)
        prompts, template = await self._prompts(body, chat)
        echo = not chat and body.echo
        if echo and self.engine.tokenizer is None:
            raise InvalidRequestError(f"echo needs a tokenizer (to write the prompt's text); {NO_TOKENIZER}")
        parses_tools = chat and body.parses_tools()  # (refused before any sample is submitted)
        tool_format = DEFAULT
        if parses_tools:
            tool_format = tool_call_format(self.tool_call_parser, template, engine.info.architecture)
            if keeps_special_tokens(tool_format):  # (vLLM's: the calls' mark is a special token)
                params.skip_special_tokens = False
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if ignored := body.ignored_fields():  # (vLLM's warning)
            # Quoted (a newline in a name would forge a log line) and cut short (a request may name
            # thousands).
            names = ", ".join(repr(name[:64]) for name in ignored[:MAX_LOGGED_FIELDS])
            more = f" and {len(ignored) - MAX_LOGGED_FIELDS} more" if len(ignored) > MAX_LOGGED_FIELDS else ""
            logger.warning(
                "request %s: these fields were present in the request but ignored (not supported): %s%s",
                request_id,
                names,
                more,
            )
        choices: list[_Choice] = []
        arrival = time.perf_counter()
        try:
            for p, prompt in enumerate(prompts):
                ids = (
                    await self._encode(prompt, params, body.add_special_tokens)
                    if isinstance(prompt, str)
                    else list(prompt)
                )
                kept = truncate_prompt(ids, params, engine.limits.max_model_len)
                name = request_id if len(prompts) == 1 else f"{request_id}-{p}"
                # (decoded before it is submitted: if cut short, it leaves nothing running; a
                # truncated prompt echoes the text of the tokens kept, which its logprobs are for)
                text = (
                    await self._prompt_text(prompt if kept is ids else kept, params, engine.limits)
                    if echo
                    else None
                )
                ids = kept
                for stream in await self.engine.submit(name, ids, params, arrival, timeout, body.user):
                    # (the text decoded as the prompt's continuation: a word's leading space kept)
                    output = OutputProcessor(self.engine.tokenizer, stream.params, ids)
                    choice = _Choice(len(choices), stream, output, prompt_token_ids=ids)
                    if echo:
                        choice.prompt_text, choice.first_prompt_token = text, ids[0]
                        choice.prompt_only = body.prompt_only
                    if template is not None:
                        choice.parser = ChatOutputParser.for_request(
                            template, prompt, parses_tools, tool_format
                        )
                    choices.append(choice)
        except BaseException:
            for choice in choices:
                self.engine.abort(choice.stream)
            raise
        return choices, request_id

    async def _prompt_text(
        self, prompt: str | list[int], params: SamplingParams, limits: SchedulerLimits
    ) -> str:
        """An echoed prompt's text: as sent, or its token ids' text (special tokens included, as
        /detokenize writes them). Ids are checked first: the decoder raises for a negative one."""
        if isinstance(prompt, str):
            return prompt
        verify_prompt_length(len(prompt), params, limits.max_model_len)
        verify_token_ids(prompt, limits.vocab_size)
        return await _decoded(self.engine.tokenizer, prompt)

    # -- vLLM's tokenizer endpoints ---------------------------------------------------------

    async def _tokenize(self, body: TokenizeRequest) -> JSONResponse:
        engine = self._engine()
        if (unknown := self._unknown_model(body.model, engine.info.model)) is not None:
            raise unknown
        try:
            chat = body.chat()
            if chat is None:
                text, add_special_tokens = body.prompt, body.add_special_tokens is not False
            else:  # (rendered as a chat completion's prompt: the template writes its special tokens)
                prompts, _ = await self._prompts(chat, chat=True)
                text, add_special_tokens = prompts[0], bool(body.add_special_tokens)
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise InvalidRequestError(NO_TOKENIZER)
            verify_unicode(text, "the prompt")
        except TandemRequestError as e:
            raise HttpError(HTTP_STATUS[e.code], e.message) from None
        ids = await encode_text(tokenizer, text, add_special_tokens)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": engine.limits.max_model_len,
                "tokens": ids,
                # (vLLM's: the vocabulary's strings, as convert_ids_to_tokens; not the tokens' text)
                "token_strs": [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None,
            }
        )

    async def _detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        engine = self._engine()
        if (unknown := self._unknown_model(body.model, engine.info.model)) is not None:
            raise unknown
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise HttpError(400, NO_TOKENIZER)
        # The ids a prompt may have and the model may generate: the model's vocabulary, not the
        # tokenizer's (a model's may be padded past it: those ids' text is empty, here as in an
        # answer; ids only the tokenizer knows are no prompt's).
        try:
            verify_token_ids(body.tokens, engine.limits.vocab_size)
        except InvalidRequestError as e:
            raise HttpError(400, e.message) from None
        return JSONResponse({"prompt": await _decoded(tokenizer, body.tokens)})  # (vLLM's: all of them)

    async def _serve(self, request: Request, body, chat: bool):
        timeout = request.headers.get(TIMEOUT_HEADER)
        seconds = None
        if timeout is not None:
            try:  # (float() takes "1_0" as 10: a digit separator is no part of a header's number)
                seconds = math.nan if "_" in timeout else float(timeout)
            except ValueError:
                seconds = math.nan
            # (a NaN or infinite deadline would never pass; a negative one passed before the start)
            if not (math.isfinite(seconds) and seconds > 0):
                raise self._fail(
                    InvalidRequestError(
                        f"{TIMEOUT_HEADER} must be a positive, finite number of seconds, got {timeout!r}"
                    )
                )
        try:
            choices, request_id = await self._admit(body, chat, seconds)
        except TandemRequestError as e:
            e.message = body.as_sent(e.message)
            raise self._fail(e) from None
        except ValueError as e:
            raise self._fail(InvalidRequestError(body.as_sent(str(e)))) from None
        writer = _ResponseWriter(self, body, chat, choices, request_id)
        if body.stream:
            return StreamingResponse(writer.sse(), media_type="text/event-stream")
        return await writer.whole(request)


def body_too_large(limit: int, size: int | None = None) -> str:
    what = "the request body" if size is None else f"the request body of {size} bytes"
    return f"{what} exceeds the limit of {limit} bytes"


class _LimitBody:
    """ASGI middleware: a request body over `limit` bytes is a 413 naming the limit, at once from its
    Content-Length, or (a body of unannounced length) as soon as the bytes read pass the limit, before
    the app holds it all or parses it."""

    def __init__(self, app, server: OpenAIServer, limit: int) -> None:
        self.app, self.server, self.limit = app, server, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            self.server.count_too_large(scope["path"])
            await _error_response(413, body_too_large(self.limit, int(declared)))(scope, receive, send)
            return
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # (the app's handler answers it: FastAPI re-raises these)
                    raise StarletteHTTPException(413, body_too_large(self.limit))
            return message

        await self.app(scope, receive_within_limit, send)


class _RequireApiKey:
    """ASGI middleware: a /v1 request (or /tokenize, /detokenize) without a valid key is a 401
    before its body is read and validated (as vLLM's); /health needs none."""

    def __init__(self, app, server: OpenAIServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path in _TOKENIZER_PATHS):
            refusal = self.server._refuse_unauthorized(Headers(scope=scope))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _choice_deltas(
    engine: AsyncEngine, choice: _Choice, interval: int = 1
) -> AsyncIterator[tuple[str, list[int], list[TokenLogprob], bool]]:
    """(text delta, its token ids, their logprobs, last) as the engine produces them, `interval`
    tokens at least a delta but the last (none of them for a prompt echoed alone, which ends for
    its length); the stream's failure is raised as TandemRequestError."""
    stream, output = choice.stream, choice.output
    while True:
        await stream.wait(interval)
        if stream.failure is not None:
            raise stream.failure
        finished = stream.finished
        ids, logprobs = stream.take()
        delta = output.add(ids, finished, stream.finish_reason)
        if delta.stopped:
            ids, logprobs = ids[: delta.num_tokens], logprobs[: delta.num_tokens]
            engine.abort(stream)
            stream.finished = finished = True
        if finished:
            choice.finish_reason, choice.stop_reason = output.finish(
                stream.finish_reason, stream.last_token_id
            )
            if choice.prompt_only:
                choice.finish_reason, choice.stop_reason = "length", None
        if choice.prompt_only:
            yield "", [], [], finished
        else:
            yield delta.text, list(ids), logprobs, finished
        if finished:
            return


class _ResponseWriter:
    def __init__(
        self, server: OpenAIServer, body, chat: bool, choices: list[_Choice], request_id: str
    ) -> None:
        self.server, self.engine, self.body, self.chat = server, server.engine, body, chat
        self.choices, self.request_id = choices, request_id
        self.created = int(time.time())
        self.model = self.engine.engine.info.model if self.engine.engine is not None else body.model
        self.tokenizer = self.engine.tokenizer
        self.num_top = (body.num_top_logprobs if body.logprobs else None) if chat else body.logprobs
        self.return_token_ids = bool(body.return_token_ids)

    def _count_finished(self, choice: _Choice) -> None:
        """A choice's final answer in the metrics, as gRPC's final message is counted."""
        metrics = self.server.metrics
        metrics.requests_finished.labels(choice.finish_reason or "abort").inc()
        metrics.e2e.observe(time.perf_counter() - choice.stream.arrival)
        metrics.request_prompt_tokens.observe(choice.stream.num_prompt_tokens)
        metrics.request_generation_tokens.observe(choice.output.num_tokens)

    def _finish_reason(self, choice: _Choice) -> str:
        if choice.parser is not None and choice.parser.calls:
            return "tool_calls"
        return choice.finish_reason or "abort"

    def usage(self) -> dict:
        prompt = sum(c.stream.num_prompt_tokens for c in self.choices[:: self.body.n])
        completion = sum(c.num_tokens for c in self.choices)
        cached = sum(c.stream.num_cached_tokens for c in self.choices[:: self.body.n])
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _token(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer else str(token_id)

    def prompt_logprobs(self, choice: _Choice) -> list | None:
        """vLLM's prompt_logprobs: None for the first prompt token, then for each token a map from
        token id (its own and its top alternatives') to logprob, rank and text."""
        lps = self._scored_prompt(choice)
        if lps is None:
            return None
        num_top = self.body.prompt_logprobs  # (echo may have scored it with more: prompt_logprobs_of)
        out: list[dict | None] = [None]
        for lp in lps:
            entry = {
                str(lp.token_id): {
                    "logprob": _logprob(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": self._token(lp.token_id),
                }
            }
            for rank, (t, v) in enumerate(lp.top_logprobs[:num_top], 1):
                entry.setdefault(
                    str(t), {"logprob": _logprob(v), "rank": rank, "decoded_token": self._token(t)}
                )
            out.append(entry)
        return out

    def _scored_prompt(self, choice: _Choice) -> list[TokenLogprob] | None:
        """The logprobs of the choice's prompt tokens after the first (None: not scored, or not yet).
        The first sample of a prompt scores it (SamplingParams.for_samples)."""
        return self.choices[choice.index - choice.stream.index].stream.prompt_logprobs

    def _echoed_logprobs(self, choice: _Choice) -> dict:
        """The completion logprobs of an echoed prompt's tokens: the first has none (null)."""
        entries = [(choice.first_prompt_token, None)]
        entries += [(lp.token_id, lp) for lp in self._scored_prompt(choice) or []]
        return self._completion_logprobs(entries, 0)

    def _completion_logprobs(self, entries: list[tuple[int, TokenLogprob | None]], offset: int) -> dict:
        """OpenAI's legacy format: each token, its logprob, the top N and always the token itself
        (up to N + 1, as vLLM's), and where it starts in the choice's text; null where a token has
        none (an echoed prompt's first)."""
        tokens, offsets, values, tops = [], [], [], []
        for token_id, lp in entries:
            token = self._token(token_id)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            values.append(None if lp is None else _logprob(lp.logprob))
            tops.append(
                None
                if lp is None
                else {
                    token: _logprob(lp.logprob),
                    **{self._token(i): _logprob(v) for i, v in lp.top_logprobs[: self.num_top]},
                }
            )
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def logprobs(
        self, logprobs: list[TokenLogprob], offset: int = 0, echoed: _Choice | None = None
    ) -> dict | None:
        """The chat or completion logprobs of generated tokens whose text starts at `offset`; those of
        `echoed`'s prompt before them."""
        if self.num_top is None:
            return None
        if self.chat:
            content = []
            for lp in logprobs:
                token = self._token(lp.token_id)
                top = [
                    {"token": (t := self._token(i)), "logprob": _logprob(v), "bytes": list(t.encode())}
                    for i, v in lp.top_logprobs[: self.num_top]
                ]
                content.append(
                    {
                        "token": token,
                        "logprob": _logprob(lp.logprob),
                        "bytes": list(token.encode()),
                        "top_logprobs": top,
                    }
                )
            return {"content": content}
        generated = self._completion_logprobs([(lp.token_id, lp) for lp in logprobs], offset)
        if echoed is None:
            return generated
        prompt = self._echoed_logprobs(echoed)
        return {key: prompt[key] + generated[key] for key in prompt}

    # -- whole responses ----------------------------------------------------------------------

    async def _collect(self, choice: _Choice) -> None:
        async for text, ids, logprobs, last in _choice_deltas(self.engine, choice):
            choice.text.append(text)
            choice.token_ids.extend(ids)
            choice.logprobs.extend(logprobs)
            if last:
                return

    async def whole(self, request: Request) -> JSONResponse:
        work = asyncio.gather(*(self._collect(c) for c in self.choices))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away
                work.cancel()
                self.server.metrics.requests_failed.labels("CANCELLED").inc()
                # (read, so that asyncio does not log the cancelled gather as an unretrieved error)
                work.add_done_callback(lambda w: w.cancelled() or w.exception())
                return _error_response(499, "the client closed the connection")
            work.result()
        except TandemRequestError as e:
            raise self.server._fail(e) from None
        finally:
            gone.cancel()
            self._abort_unfinished()
        for choice in self.choices:
            self._count_finished(choice)
        response = {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._whole_choice(c) for c in self.choices],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self.usage(),
        }
        if self.chat:  # vLLM's place for the prompt's logprobs and ids in chat (null unless asked)
            response["prompt_logprobs"] = self._asked_prompt_logprobs(self.choices[0])
            response["prompt_token_ids"] = self._token_ids(self.choices[0].prompt_token_ids)
        return JSONResponse(response)

    def _asked_prompt_logprobs(self, choice: _Choice) -> list | None:
        """The prompt_logprobs asked for (None: not asked; an echo's scoring is no answer to it)."""
        return self.prompt_logprobs(choice) if self.body.prompt_logprobs is not None else None

    def _token_ids(self, ids: list[int]) -> list[int] | None:
        """vLLM's return_token_ids: the ids, if asked for."""
        return list(ids) if self.return_token_ids else None

    def _whole_choice(self, choice: _Choice) -> dict:
        text = "".join(choice.text)
        if choice.prompt_text is not None:  # echoed: the prompt, then what was generated
            logprobs = self.logprobs(choice.logprobs, len(choice.prompt_text), echoed=choice)
            text = choice.prompt_text + text
        else:
            logprobs = self.logprobs(choice.logprobs)
        if not self.chat:
            return {
                "index": choice.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": self._finish_reason(choice),
                "stop_reason": choice.stop_reason,
                "prompt_logprobs": self._asked_prompt_logprobs(choice),
                "prompt_token_ids": self._token_ids(choice.prompt_token_ids),
                "token_ids": self._token_ids(choice.token_ids),
            }
        split = choice.split(text, last=True)
        calls = choice.parser.calls if choice.parser is not None else []
        message: dict[str, Any] = {"role": "assistant", "content": split.content or (None if calls else "")}
        if choice.parser is not None and choice.parser.reasoning is not None:
            # (vLLM's name is now "reasoning"; clients of earlier vLLM, DeepSeek's, read reasoning_content)
            message["reasoning"] = message["reasoning_content"] = split.reasoning or None
        message["tool_calls"] = [c.to_openai() for c in calls]
        return {
            "index": choice.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self._finish_reason(choice),
            "stop_reason": choice.stop_reason,
            "token_ids": self._token_ids(choice.token_ids),
        }

    def _abort_unfinished(self) -> None:
        for choice in self.choices:
            if not choice.stream.finished:
                self.engine.abort(choice.stream)

    # -- server-sent events ---------------------------------------------------------------------

    def _chunk(
        self, choices: list[dict], usage: dict | None = None, prompt_token_ids: list | None = None
    ) -> str:
        chunk = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        if prompt_token_ids is not None:  # (a chat's, in its first chunks: vLLM's)
            chunk["prompt_token_ids"] = prompt_token_ids
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def _delta(
        self, choice: _Choice, text: str, ids: list[int], logprobs: list[TokenLogprob], last: bool
    ) -> dict | None:
        finish = self._finish_reason(choice) if last else None
        stop = choice.stop_reason if last else None
        echo = choice.prompt_text is not None and not choice.text  # (the prompt, in its first chunk)
        if echo:
            lp = self.logprobs(logprobs, len(choice.prompt_text), echoed=choice)
            text = choice.prompt_text + text
        else:
            lp = self.logprobs(logprobs, sum(len(t) for t in choice.text)) if logprobs else None
        choice.text.append(text)
        # (a delta of ids without text, inside a character or a tool call's markup, still carries them)
        sends_ids = self.return_token_ids and bool(ids)
        if not self.chat:
            prompt_lp = None
            if self.body.prompt_logprobs is not None and not choice.sent_prompt_logprobs:
                prompt_lp = self.prompt_logprobs(choice)
                choice.sent_prompt_logprobs = prompt_lp is not None
            if not text and not last and not logprobs and prompt_lp is None and not echo and not sends_ids:
                return None
            delta = {
                "index": choice.index,
                "text": text,
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": stop,
            }
            if prompt_lp is not None:  # in the first chunk (vLLM's streamed completions)
                delta["prompt_logprobs"] = prompt_lp
            if self.return_token_ids:  # the prompt's in the choice's first chunk, as vLLM's
                if not choice.sent_prompt_token_ids:
                    delta["prompt_token_ids"] = list(choice.prompt_token_ids)
                    choice.sent_prompt_token_ids = True
                delta["token_ids"] = ids
            return delta
        split = choice.split(text, last)
        delta: dict[str, Any] = {}
        if split.reasoning:
            delta["reasoning"] = delta["reasoning_content"] = split.reasoning
        if split.content:
            delta["content"] = split.content
        if split.tool_calls:  # OpenAI's: a call's index, id and name first, then its arguments
            delta["tool_calls"] = [c.to_openai() for c in split.tool_calls]
        if not delta and not last and not logprobs and not sends_ids:
            return None
        if last:  # the finish reason may be "tool_calls" only now
            finish = self._finish_reason(choice)
        streamed = {
            "index": choice.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": stop,
        }
        if self.return_token_ids:
            streamed["token_ids"] = ids
        return streamed

    async def sse(self) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                if choice.prompt_text is not None and self.num_top is not None and choice.stream.index:
                    # An echoed prompt comes with its logprobs, which its first sample scores.
                    await _prompt_scored(self.choices[choice.index - choice.stream.index].stream)
                async for item in _choice_deltas(self.engine, choice, self.server.stream_interval):
                    await queue.put((choice, *item))
            except TandemRequestError as e:
                await queue.put((choice, e))

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        left, failed = len(self.choices), False
        options = self.body.stream_options
        include_usage = options is not None and bool(options.include_usage)
        # vLLM's continuous_usage_stats: each chunk carries the usage so far.
        continuous = include_usage and bool(options.continuous_usage_stats)
        try:
            if self.chat:  # each choice's role first, a chunk each (as OpenAI's and vLLM's)
                prompt_ids = self._token_ids(self.choices[0].prompt_token_ids)
                for c in self.choices:
                    first = {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield self._chunk([first], self.usage() if continuous else None, prompt_ids)
            while left:
                choice, *item = await queue.get()
                if isinstance(item[0], TandemRequestError):
                    error = item[0]
                    self.server.metrics.requests_failed.labels(error.code.name).inc()
                    failed = True
                    yield f"data: {json.dumps(error_body(error.message, HTTP_STATUS[error.code]))}\n\n"
                    break
                text, ids, logprobs, last = item
                delta = self._delta(choice, text, ids, logprobs, last)
                if delta is not None:
                    yield self._chunk([delta], self.usage() if continuous else None)
                if last:
                    left -= 1
                    self._count_finished(choice)
            else:
                if include_usage:
                    yield self._chunk([], self.usage())
            yield "data: [DONE]\n\n"
        finally:  # finished, failed, or the client went away (the generator is closed)
            if left and not failed:  # counted as gRPC counts a cancelled call
                self.server.metrics.requests_failed.labels("CANCELLED").inc()
            for task in tasks:
                task.cancel()
            self._abort_unfinished()


def _client_message(e: TandemRequestError) -> tuple[str, str | None]:
    """The error's message and code as OpenAI's clients read them: a prompt too long for the model
    (sampling_params.verify_prompt_length's refusals) leads with OpenAI's (and vLLM's) sentence and
    has OpenAI's code, which clients look for to tell it from other 400s (LiteLLM's
    ContextWindowExceededError, for one)."""
    limit = _CONTEXT_LIMIT.search(e.message) if e.code is ErrorCode.INVALID_ARGUMENT else None
    if limit is None:
        return e.message, None
    return f"This model's maximum context length is {limit[1]} tokens: {e.message}", "context_length_exceeded"


def _model_permission(created: int) -> dict:
    """The one permission a model card lists (vLLM's: sampling, logprobs and viewing allowed)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def _logprob(value: float) -> float:
    """A logprob as JSON can carry it: -inf (a token the model rules out) is vLLM's (and OpenAI's)
    -9999.0; JSON has no infinity (a whole answer failed with a 500, a stream sent -Infinity)."""
    return max(value, MIN_LOGPROB)


async def _decoded(tokenizer, ids: list[int]) -> str:
    """The ids' text, special tokens included (a prompt echoed, /detokenize); many ids are decoded
    in a thread, off the event loop."""
    if len(ids) > TOKENIZE_INLINE_CHARS:
        return await asyncio.to_thread(tokenizer.decode, ids, False)
    return tokenizer.decode(ids, skip_special_tokens=False)


async def _prompt_scored(stream: RequestStream) -> None:
    """Returns once the stream has its prompt's logprobs (they come with its first tokens), or ended."""
    while stream.prompt_logprobs is None and not stream.finished:
        stream.event.clear()
        await stream.event.wait()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class HttpServer:
    """uvicorn serving `app` on a socket bound here (exclusively: protos/ports.py), on the running
    loop; the scheduler's signal handlers stay the scheduler's."""

    def __init__(self, app, sock, ssl_certfile: str | None = None, ssl_keyfile: str | None = None) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
            timeout_graceful_shutdown=1,
        )
        self._server = _Server(config)
        self._sock = sock
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sock.close()
