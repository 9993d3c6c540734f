"""The messages between the engine core and its API server processes (engine_core.py,
api_server.py): ZeroMQ frames of msgpack arrays, `[kind, ...]`.

One ROUTER socket in the engine core, one DEALER per API server (its identity `api-<i>`):

    API server -> core                          core -> API server
    ["hello"]                                   ["state", state]          (on hello, on each change)
    ["add", key, request_id, prompt_ids,        ["added", key, [engine id of each sample]] or
     params, arrival, timeout, user]            ["refused", key, code, message]
    ["abort", engine_id]                        ["out", [entry, ...]]     (once per engine step)
    ["metrics", [record, ...]]

An API server says hello once it serves (its port bound): the core counts the hellos to know that
every API server has started.

`state`: {"info": ExecutorInfo fields or None, "limits": SchedulerLimits fields or None,
"message": why not connected, "admitting": bool}. `entry`: [engine_id, new token ids,
logprobs or None, prompt logprobs or None (once), cached tokens, finished, finish reason, failure
code or None, failure message] with logprobs as [token id, logprob, [[id, logprob], ...], rank].
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
