"""tandem.v1.GenerationService: admission, streaming and errors as status codes (grpc.aio)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc

from protos.defaults import GENERATION_MAX_MESSAGE_BYTES
from protos.parsing import MalformedMessage
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from scheduler_service.async_engine import AsyncEngine
from scheduler_service.chat_output import ChatDelta, ChatOutputParser
from scheduler_service.chat_template import ChatTemplate
from scheduler_service.errors import ErrorCode, InvalidRequestError, TandemRequestError
from scheduler_service.openai_protocol import calls_for_template, check_tool_calls
from scheduler_service.request_handling import (
    NO_TOKENIZER,
    RENDER_INLINE_MESSAGES,
    OutputProcessor,
    chat_template,
    check_text_prompt,
    encode_text,
    verify_request_id,
    verify_tokenizer,
    verify_tools,
)
from scheduler_service.request_stream import RequestStream
from scheduler_service.response_chunks import logprobs_to_proto, split_logprobs, split_text, split_tokens
from scheduler_service.sampling_params import (
    SamplingParams,
    truncate_prompt,
    verify_prompt_length,
)
from scheduler_service.tool_call_formats import (
    AUTO,
    DEFAULT,
    check_tool_call_parser,
    keeps_special_tokens,
    tool_call_format,
)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
_STATUS_CODES = {code: getattr(grpc.StatusCode, code.name) for code in ErrorCode}
# The client's own deadline timer fires first and cancels the call, a few ms before ours.
DEADLINE_SLACK_S = 0.1
# How long a call whose request stream ended without a message waits for gRPC to cancel it (it
# does within a millisecond when it refused the message for its size) before it is refused as sent
# without one.
NO_REQUEST_WAIT_S = 0.2


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Proto3 zero values mean "unset"; raises InvalidRequestError naming the limit."""
    if msg.HasField("max_tokens") and msg.max_tokens < 1:
        raise InvalidRequestError(
            f"max_tokens must be >= 1 (unset: up to max_model_len), got {msg.max_tokens}"
        )
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        n=msg.n or 1,
        min_tokens=msg.min_tokens,
        logit_bias=dict(msg.logit_bias),
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(
            msg.spaces_between_special_tokens if msg.HasField("spaces_between_special_tokens") else True
        ),
        truncate_prompt_tokens=(
            msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None
        ),
    )


def _json_field(where: str, raw: str):
    """A JSON field of a Chat message, or InvalidRequestError naming it."""
    try:
        return json.loads(raw)
    except ValueError as e:  # (not JSON, or an integer past Python's 4,300 digits)
        raise InvalidRequestError(f"{where} is not JSON: {e}") from None
    except RecursionError:
        raise InvalidRequestError(f"{where} is nested too deeply") from None


def render_chat(tokenizer, chat: pb.Chat) -> tuple[str, ChatTemplate, bool]:
    """The prompt text of a Chat message, its template and whether it has tools (whose calls the
    answer is parsed for); InvalidRequestError for bad JSON or what the template refuses."""
    fields = {}
    for name, raw in (
        ("chat_template_kwargs_json", chat.chat_template_kwargs_json),
        ("tools_json", chat.tools_json),
    ):
        fields[name] = _json_field(f"chat.{name}", raw) if raw else None
    kwargs = fields["chat_template_kwargs_json"] or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat.chat_template_kwargs_json must be a JSON object")
    tools = fields["tools_json"]
    # As the HTTP API's `tools`: a list of objects, and an empty one (or null) is no tools.
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError(
            f"chat.tools_json must be a JSON array of tool objects (OpenAI's tools), got {chat.tools_json[:100]}"
        )
    verify_tools(tools, "chat.tools_json")
    messages = []
    for i, m in enumerate(chat.messages):
        if not m.role:  # (proto3: unset is empty; HTTP's messages need one too)
            raise InvalidRequestError(f"chat.messages[{i}] has no role")
        message = {"role": m.role, "content": m.content}
        # An assistant's past tool calls, as the HTTP API takes them: without them a conversation
        # that goes on after a tool call renders the call's turn empty, its result answering nothing.
        if m.tool_calls_json:
            where = f"chat.messages[{i}].tool_calls_json"
            calls = _json_field(where, m.tool_calls_json)
            check_tool_calls(calls, where)
            message["tool_calls"] = calls_for_template(calls)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    if not messages:
        raise InvalidRequestError("chat.messages is empty")
    template = chat_template(tokenizer)
    text = template.render(messages, tools=tools, chat_template_kwargs=kwargs)
    return text, template, bool(tools)


# The largest chunk a stream sends (see GenerationServicer.__init__).
_MAX_CHUNK_BYTES = 2 * 2**20


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        stream_interval: int = 1,
        max_message_bytes: int = GENERATION_MAX_MESSAGE_BYTES,
        tool_call_parser: str = AUTO,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.engine = engine
        self.metrics = engine.metrics
        self.stream_interval = stream_interval
        # The format a Chat answer's tool calls are read in (--tool-call-parser; tool_call_formats.py).
        self.tool_call_parser = check_tool_call_parser(tool_call_parser)
        self.max_message_bytes = max_message_bytes
        # A chunk: half of the message for token ids and logprobs, a quarter for text (UTF-8: at
        # most 4 bytes a character), the rest for the request id and framing; and no chunk over
        # about 1 MiB, under the 4 MiB that grpcurl and the Go and Java clients take by default.
        limit = min(max_message_bytes, _MAX_CHUNK_BYTES)
        self._chunk_token_bytes = limit // 2
        self._chunk_text_chars = limit // 16

    async def _fail(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.metrics.requests_failed.labels(code.name).inc()
        await context.abort(code, message)

    async def _admit(
        self, request: pb.GenerateRequest, request_id: str, arrival: float, timeout: float | None
    ) -> list[tuple[RequestStream, ChatOutputParser | None, list[int]]]:
        """One stream per sample (n), with the parser that splits a Chat prompt's answer, and the
        prompt's ids (whose continuation its text is decoded as)."""
        verify_request_id(request.request_id)
        params = sampling_params_from_proto(request.sampling_params)
        tokenizer = self.engine.tokenizer
        verify_tokenizer(params, tokenizer, NO_TOKENIZER)
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError(
                "prompt is empty: the GenerateRequest sets none of text, token_ids and chat"
            )
        if kind in ("text", "chat"):
            # No work for a prompt that cannot be served: no executor (UNAVAILABLE), no tokenizer,
            # or a text too long to fit (a lower bound on its tokens, without tokenizing).
            engine = self.engine.check_admitting()
            tools = False
            if kind == "text":
                text, template = request.text, None
            elif len(request.chat.messages) > RENDER_INLINE_MESSAGES:
                # In a thread: the event loop (health, other streams) runs meanwhile.
                text, template, tools = await asyncio.to_thread(render_chat, tokenizer, request.chat)
            else:
                text, template, tools = render_chat(tokenizer, request.chat)
            tool_format = DEFAULT
            if tools:
                tool_format = tool_call_format(self.tool_call_parser, template, engine.info.architecture)
                if keeps_special_tokens(tool_format):  # (as the HTTP API's: the calls' mark is special)
                    params.skip_special_tokens = False
            max_model_len = engine.limits.max_model_len
            tokenizer = check_text_prompt(tokenizer, text, params, max_model_len)
            # (a chat template writes its own special tokens)
            prompt = await encode_text(tokenizer, text, add_special_tokens=kind == "text")
            prompt = truncate_prompt(prompt, params, max_model_len)
        else:
            # Its length checked before its ids become a list: a 14 MiB message of 15M ids held the
            # event loop (health, other streams) for ~0.5 s on its way to the same refusal.
            ids = request.token_ids.ids
            max_model_len = self.engine.check_admitting().limits.max_model_len
            ids = truncate_prompt(ids, params, max_model_len)
            verify_prompt_length(len(ids), params, max_model_len)
            prompt, template = list(ids), None
        streams = await self.engine.submit(request_id, prompt, params, arrival, timeout, request.user)
        if template is None:
            return [(stream, None, prompt) for stream in streams]
        return [
            (stream, ChatOutputParser.for_request(template, text, tools, tool_format), prompt)
            for stream in streams
        ]

    async def Generate(
        self,
        requests: AsyncIterator[pb.GenerateRequest | MalformedMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Served as a stream-request handler (the same on the wire for unary clients), so that a
        request that gRPC refused for its size still comes here, as no message, and is counted."""
        arrival = time.perf_counter()
        request = await context.read()
        if request is grpc.aio.EOF:
            await self._no_request(context)
        if isinstance(request, MalformedMessage):
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, request.error)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        try:
            samples = await self._admit(request, request_id, arrival, context.time_remaining())
        except TandemRequestError as e:
            await self._fail(context, _STATUS_CODES[e.code], e.message)
        except ValueError as e:  # anything else a request can get wrong
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.CancelledError:  # while it was tokenized or admitted (by a slow engine core)
            self._count_gone(context)
            raise
        streams = [stream for stream, *_ in samples]
        num_finals = 0
        failed = False
        try:
            # One sample's responses straight from its generator (no generator around it).
            responses = self._responses(*samples[0]) if len(samples) == 1 else self._samples(samples)
            async for response in responses:
                yield response  # returns once gRPC has taken the message
                if response.WhichOneof("payload") == "final":
                    num_finals += 1
                    reason = next(k for k, v in _FINISH_REASONS.items() if v == response.final.finish_reason)
                    # (the metric counts the engine's reasons: tool calls end in a stop)
                    self.metrics.requests_finished.labels("stop" if reason == "tool_calls" else reason).inc()
        except TandemRequestError as e:
            failed = True
            await self._fail(context, _STATUS_CODES[e.code], e.message)
        finally:
            for stream in streams:
                if not stream.finished:  # the client cancelled, its deadline passed, or a sample failed
                    self.engine.abort(stream)
            if num_finals < len(streams) and not failed:
                self._count_gone(context)

    async def _no_request(self, context: grpc.aio.ServicerContext) -> None:
        """The request stream ended without a message: gRPC refused one over the message limit (the
        client has RESOURCE_EXHAUSTED from gRPC, which cancels this handler a moment later), or the
        client sent none (INVALID_ARGUMENT). Only the cancellation tells them apart."""
        try:
            await asyncio.sleep(NO_REQUEST_WAIT_S)
        except asyncio.CancelledError:  # (or a client that cancelled before its message: rare)
            self.metrics.requests_failed.labels(grpc.StatusCode.RESOURCE_EXHAUSTED.name).inc()
            raise
        await self._fail(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            "no GenerateRequest arrived: the client closed the request stream before sending one (a "
            "Generate call sends exactly one GenerateRequest)",
        )

    def _count_gone(self, context: grpc.aio.ServicerContext) -> None:
        """A call that ended before its answer without an error of ours: cancelled, past its
        deadline, or a message that could not be sent."""
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= DEADLINE_SLACK_S
        code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
        self.metrics.requests_failed.labels(code.name).inc()

    async def _samples(
        self, samples: list[tuple[RequestStream, ChatOutputParser | None, list[int]]]
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Every sample's responses, interleaved as they come; a failed sample's TandemRequestError
        is raised."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(samples))

        async def pump(stream: RequestStream, parser: ChatOutputParser | None, prompt: list[int]) -> None:
            try:
                async for response in self._responses(stream, parser, prompt):
                    await queue.put(response)
            except TandemRequestError as e:
                await queue.put(e)
            else:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(*sample)) for sample in samples]
        try:
            left = len(samples)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, TandemRequestError):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _responses(
        self,
        stream: RequestStream,
        parser: ChatOutputParser | None,
        prompt: Sequence[int] = (),
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One sample's chunks, then its final message; its failure raised as TandemRequestError.
        prompt: its prompt's ids (the text is decoded as their continuation, so that a first word
        keeps its leading space)."""
        tokenizer = self.engine.tokenizer
        output = OutputProcessor(tokenizer, stream.params, prompt)
        request_id, index = stream.request_id, stream.index
        prompt_logprobs_sent = stream.params.prompt_logprobs is None
        while True:
            await stream.wait(self.stream_interval)
            if stream.failure is not None:
                raise stream.failure
            # Read together with the tokens: more may arrive while the chunks are written.
            finished = stream.finished
            ids, logprobs = stream.take()
            if not prompt_logprobs_sent and stream.prompt_logprobs is not None:
                prompt_logprobs_sent = True
                entries = logprobs_to_proto(stream.prompt_logprobs, tokenizer)
                for part in split_logprobs(entries, self._chunk_token_bytes):
                    chunk = pb.GenerateChunk(prompt_logprobs=part)
                    yield pb.GenerateResponse(request_id=request_id, chunk=chunk, index=index)
            entries = logprobs_to_proto(logprobs, tokenizer)
            pieces = list(split_tokens(ids, entries, self._chunk_token_bytes))
            for i, (ids, logprobs) in enumerate(pieces):
                last = finished and i == len(pieces) - 1
                delta = output.add(ids, last, stream.finish_reason if last else None)
                if delta.stopped:
                    ids, logprobs = ids[: delta.num_tokens], logprobs[: delta.num_tokens]
                    self.engine.abort(stream)
                    stream.finished = finished = True
                split = ChatDelta(content=delta.text)
                if parser is not None:
                    split = parser.add(delta.text, last or delta.stopped)
                if ids or split.content or split.reasoning or split.tool_calls:
                    for chunk in self._chunks(split):
                        if ids:  # the tokens go with the first chunk
                            chunk.token_ids.extend(ids)
                            chunk.logprobs.extend(logprobs)
                            ids = []
                        yield pb.GenerateResponse(request_id=request_id, chunk=chunk, index=index)
                if delta.stopped:
                    break
            if finished:
                final = self._final(stream, output)
                if parser is not None and parser.calls:
                    final.finish_reason = pb.FINISH_REASON_TOOL_CALLS
                yield pb.GenerateResponse(request_id=request_id, final=final, index=index)
                return

    def _chunks(self, split: ChatDelta) -> list[pb.GenerateChunk]:
        """A delta's text in chunks under the message limit: reasoning, then content, then tool calls."""
        size = self._chunk_text_chars
        chunks = [pb.GenerateChunk(reasoning_content=r) for r in split_text(split.reasoning, size) if r]
        chunks += [pb.GenerateChunk(text=c) for c in split_text(split.content, size) if c]
        if not chunks:
            chunks.append(pb.GenerateChunk())
        chunks[-1].tool_calls.extend(
            pb.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "", arguments=d.arguments)
            for d in split.tool_calls
        )
        return chunks

    def _final(self, stream: RequestStream, output: OutputProcessor) -> pb.GenerateFinal:
        reason, stop = output.finish(stream.finish_reason, stream.last_token_id)
        metrics = self.metrics
        metrics.e2e.observe(time.perf_counter() - stream.arrival)
        metrics.request_prompt_tokens.observe(stream.num_prompt_tokens)
        metrics.request_generation_tokens.observe(output.num_tokens)
        final = pb.GenerateFinal(
            finish_reason=_FINISH_REASONS[reason],
            prompt_tokens=stream.num_prompt_tokens,
            completion_tokens=output.num_tokens,
            cached_tokens=stream.num_cached_tokens,
            stop_reason="" if stop is None else str(stop),  # (its text too, for older clients)
        )
        if isinstance(stop, int):  # a stop token id, told apart from a string
            final.stop_token_id = stop
        return final

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | MalformedMessage, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        if isinstance(request, MalformedMessage):
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, request.error)
        engine = self.engine.engine
        if engine is None:
            await self._fail(
                context,
                grpc.StatusCode.UNAVAILABLE,
                self.engine.not_connected_message(),
            )
        info = engine.info
        return pb.GetModelInfoResponse(
            model=info.model,
            max_model_len=engine.limits.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            tensor_parallel_size=info.tensor_parallel_size,
            dtype=info.dtype,
            device=info.device,
            max_logprobs=engine.limits.max_logprobs,
        )
