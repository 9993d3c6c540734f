"""The messages between the engine core and its API server processes (engine_core.py,
api_server.py): ZeroMQ frames of msgpack arrays, `[kind, ...]`.

One ROUTER socket in the engine core, one DEALER per API server (its identity `api-<i>`):

    API server -> core                          core -> API server
    ["hello"]                                   ["state", state]          (on hello, on each change)
    ["add", key, request_id, prompt_ids,        ["added", key, [engine id of each sample]] or
     params, arrival, timeout, user]            ["refused", key, code, message]
    ["abort", engine_id]                        ["out", engine_ids, num_tokens,  (after each engine step)
    ["metrics", [record, ...]]                   token_ids, num_cached_tokens, details]

An API server says hello once it serves (its port bound): the core counts the hellos to know that
every API server has started.

`state`: {"info": ExecutorInfo fields or None, "limits": SchedulerLimits fields or None,
"message": why not connected, "admitting": bool}. "out" is one step's news for the API server's
requests (CoreBridge.step_outputs builds it for requests of tokens alone, outputs_to_wire for
the others: an API server may get both after a step), in columns (outputs_to_wire): each request's
engine id, number of new tokens and cached tokens; the new tokens of all of them in one flat
column, `num_tokens` each in order (not a list a request, which the engine thread would build and
msgpack frame for every request every step); and `details` only for the few with more than tokens:
[column index, logprobs or None, prompt logprobs or None (once), finished, finish reason, failure
code or None, failure message], with logprobs as [token id, logprob, [[id, logprob], ...], rank].
A request of n samples is n engine requests (SamplingParams.for_samples, on both sides). `record`: [metric, label values,
method, value], a call on the core's SchedulerMetrics (`requests_finished.labels("stop").inc(1)`).
`arrival` is time.perf_counter() of the API server: CLOCK_MONOTONIC on Linux, one clock for every
process of the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Sequence

import msgpack

from protos.plan import ExecutorInfo
from scheduler_service.config import SchedulerLimits
from scheduler_service.errors import ErrorCode, TandemRequestError
from scheduler_service.request_stream import RequestStream
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.sequence import TokenLogprob


def pack(*message: object) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> list:
    # Integer keys (a logit bias by token id) are map keys too.
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def ipc_address() -> str:
    """A fresh ipc:// endpoint in a private temporary directory."""
    folder = tempfile.mkdtemp(prefix="tandem-core-")
    return f"ipc://{os.path.join(folder, 'engine.sock')}"


def remove_ipc_address(address: str) -> None:
    """Remove what ipc_address made (the socket file and its folder)."""
    path = address.removeprefix("ipc://")
    if path != address:
        folder = os.path.dirname(path)
        with contextlib.suppress(OSError):
            os.remove(path)
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def params_to_wire(params: SamplingParams) -> dict:
    return dataclasses.asdict(params)


def params_from_wire(fields: dict) -> SamplingParams:
    return SamplingParams(**fields)


def logprobs_to_wire(logprobs: Sequence[TokenLogprob] | None) -> list | None:
    if not logprobs:
        return None
    return [[lp.token_id, lp.logprob, [list(t) for t in lp.top_logprobs], lp.rank] for lp in logprobs]


def logprobs_from_wire(wire: list | None) -> list[TokenLogprob] | None:
    if wire is None:
        return None
    return [TokenLogprob(t, lp, [(i, v) for i, v in top], rank) for t, lp, top, rank in wire]


@dataclasses.dataclass(slots=True)
class StreamOutput:
    """One step's news for a stream, in RequestOutput's fields (StreamTable.dispatch reads them)."""

    request_id: int
    new_token_ids: list[int]
    num_cached_tokens: int
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


def outputs_to_wire(streams: list[RequestStream]) -> tuple[list, list, list, list, list]:
    """Take the news accumulated in each stream (one API server's, after a step): the columns of
    an "out" message. Most streams only have new tokens, so only the others get details."""
    engine_ids = [stream.engine_id for stream in streams]
    num_tokens = []
    token_ids: list[int] = []
    num_cached_tokens = [stream.num_cached_tokens for stream in streams]
    details = []
    for i, stream in enumerate(streams):
        new, stream.token_ids = stream.token_ids, []
        if stream.finished or stream.logprobs or stream.prompt_logprobs is not None:
            failure = stream.failure
            if failure is not None:
                num_tokens.append(0)
                num_cached_tokens[i] = 0
                details.append([i, None, None, True, "abort", failure.code.name, failure.message])
                continue
            logprobs, stream.logprobs = stream.logprobs, []
            prompt_logprobs, stream.prompt_logprobs = stream.prompt_logprobs, None  # sent once
            details.append(
                [i, logprobs_to_wire(logprobs), logprobs_to_wire(prompt_logprobs), stream.finished,
                 stream.finish_reason, None, None]
            )  # fmt: skip
        num_tokens.append(len(new))
        token_ids += new
    return engine_ids, num_tokens, token_ids, num_cached_tokens, details


def outputs_from_wire(
    engine_ids: list[int],
    num_tokens: list[int],
    token_ids: list[int],
    num_cached_tokens: list[int],
    details: list[list],
) -> tuple[list[StreamOutput], dict[int, TandemRequestError]]:
    """An "out" message's outputs for StreamTable.dispatch, and its failures by engine id."""
    outputs: list[StreamOutput | None] = []
    end = 0
    for engine_id, n, cached in zip(engine_ids, num_tokens, num_cached_tokens, strict=True):
        start, end = end, end + n
        outputs.append(StreamOutput(engine_id, token_ids[start:end], cached))
    if end != len(token_ids):
        raise ValueError(f'an "out" message of {end} tokens by its counts carries {len(token_ids)}')
    failures = {}
    for i, logprobs, prompt_logprobs, finished, reason, code, message in details:
        if code is not None:
            failures[engine_ids[i]] = failure_from_wire(code, message)
            outputs[i] = None
            continue
        output = outputs[i]
        output.new_logprobs = logprobs_from_wire(logprobs)
        output.prompt_logprobs = logprobs_from_wire(prompt_logprobs)
        output.finished, output.finish_reason = finished, reason
    if failures:
        outputs = [output for output in outputs if output is not None]
    return outputs, failures


def failure_from_wire(code: str, message: str) -> TandemRequestError:
    return TandemRequestError(message, ErrorCode[code])


def state_to_wire(
    info: ExecutorInfo | None, limits: SchedulerLimits | None, message: str, admitting: bool
) -> dict:
    return {
        "info": dataclasses.asdict(info) if info is not None else None,
        "limits": dataclasses.asdict(limits) if limits is not None else None,
        "message": message,
        "admitting": admitting,
    }


def info_from_wire(fields: dict) -> ExecutorInfo:
    return ExecutorInfo(**fields)


def limits_from_wire(fields: dict) -> SchedulerLimits:
    return SchedulerLimits(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])})
