"""The engine core's "out" message (engine_ipc.py): a step's outputs go from the core's
StreamTable through its listener, msgpack and the API server's StreamTable into the streams the
client-facing code reads, which must then hold what one process's streams hold."""

from __future__ import annotations

import pytest

from scheduler_service import engine_ipc as ipc
from scheduler_service.engine import RequestOutput
from scheduler_service.errors import ErrorCode, TandemRequestError
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.request_stream import RequestStream, StreamTable
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.sequence import TokenLogprob

NUM_PROMPT_TOKENS = 5


def output(engine_id: int, new: list[int], **fields) -> RequestOutput:
    fields.setdefault("finished", False)
    fields.setdefault("finish_reason", None)
    fields.setdefault("num_cached_tokens", 0)
    return RequestOutput(engine_id, new, num_prompt_tokens=NUM_PROMPT_TOKENS, **fields)


def table(engine_ids: list[int]) -> StreamTable:
    streams = StreamTable(SchedulerMetrics())
    for engine_id in engine_ids:
        streams.add(RequestStream(f"req-{engine_id}", engine_id, NUM_PROMPT_TOKENS, SamplingParams(), 0.0))
    return streams


def state(streams: list[RequestStream]) -> list[tuple]:
    return [
        (s.engine_id, s.token_ids, s.last_token_id, s.logprobs, s.prompt_logprobs, s.num_cached_tokens,
         s.finished, s.finish_reason, s.failure and (s.failure.code, s.failure.message), s.queued_tokens)
        for s in streams
    ]  # fmt: skip


STEPS = [
    (
        [
            output(1, [7, 8], num_cached_tokens=16),
            output(2, [9], new_logprobs=[TokenLogprob(9, -0.5, [(9, -0.5), (3, -1.5)])],
                   prompt_logprobs=[TokenLogprob(4, -2.0, [(4, -2.0)], rank=1)]),
            output(3, [0], finished=True, finish_reason="stop"),
            output(4, [], finished=True, finish_reason="abort", error="does not fit in the KV cache"),
        ],
        None,
    ),
    ([output(1, [10], finished=True, finish_reason="length"), output(2, [11])], None),
    ([], {2: TandemRequestError("step 9 failed", ErrorCode.INTERNAL), 99: TandemRequestError("gone")}),
]  # fmt: skip


@pytest.mark.parametrize("num_steps", [1, len(STEPS)])
def test_api_server_streams_hold_what_one_process_holds(num_steps):
    ids = [1, 2, 3, 4]
    one_process = table(ids)
    expected = [one_process._streams[i] for i in ids]
    core, api_server = table(ids), table(ids)
    streams = [api_server._streams[i] for i in ids]
    frames = []
    core.listener = lambda touched: frames.append(ipc.pack("out", *ipc.outputs_to_wire(touched)))
    for outputs, failures in STEPS[:num_steps]:
        one_process.dispatch(outputs, failures, 1.0)
        frames.clear()
        core.dispatch(outputs, failures, 1.0)
        for frame in frames:
            kind, *columns = ipc.unpack(frame)
            assert kind == "out"
            api_server.dispatch(*ipc.outputs_from_wire(*columns), 1.0)
    assert state(streams) == state(expected)
    assert len(api_server) == len(one_process)


def test_details_go_only_with_the_outputs_that_need_them():
    core = table([1, 2, 3])
    sent = []
    core.listener = lambda touched: sent.append(ipc.outputs_to_wire(touched))
    core.dispatch(
        [output(1, [7]), output(2, [8]), output(3, [0], finished=True, finish_reason="stop")], None, 1.0
    )
    ((engine_ids, token_ids, num_cached_tokens, details),) = sent
    assert (engine_ids, token_ids, num_cached_tokens) == ([1, 2, 3], [[7], [8], [0]], [0, 0, 0])
    assert details == [[2, None, None, True, "stop", None, None]]


def test_empty_logprobs_cross_as_none():
    # (a one-token prompt scores nothing: its API server's stream has no prompt logprobs)
    core = table([1])
    sent = []
    core.listener = lambda touched: sent.append(ipc.outputs_to_wire(touched))
    core.dispatch([output(1, [7], new_logprobs=[], prompt_logprobs=[])], None, 1.0)
    _, *columns = ipc.unpack(ipc.pack("out", *sent[0]))
    (out,), failures = ipc.outputs_from_wire(*columns)
    assert (
        out.new_token_ids == [7] and out.new_logprobs is None and out.prompt_logprobs is None and not failures
    )


def test_a_message_for_an_api_server_that_cannot_take_it_is_reported_once(tmp_path, caplog):
    """The core's ROUTER reports a message it cannot deliver (an API server gone, or one whose queue
    is full because it stopped reading) in a warning, once until that server takes messages again;
    it neither raises into the step loop nor drops the message silently."""
    import asyncio
    import logging
    from types import SimpleNamespace

    import zmq
    import zmq.asyncio

    from scheduler_service.engine_core import CoreBridge

    engine = SimpleNamespace(streams=SimpleNamespace(listener=None), engine=None)
    address = f"ipc://{tmp_path}/core"

    async def run() -> None:
        bridge = CoreBridge(engine, SchedulerMetrics(), address)
        context = zmq.asyncio.Context()
        api = context.socket(zmq.DEALER)
        api.setsockopt(zmq.IDENTITY, b"api-0")
        api.setsockopt(zmq.RCVHWM, 1)
        api.setsockopt(zmq.LINGER, 0)
        try:
            with caplog.at_level(logging.WARNING, logger="scheduler_service.engine_core"):
                bridge._send(b"api-9", b"x")
                bridge._send(b"api-9", b"x")
                assert [r.getMessage() for r in caplog.records] == [
                    "API server api-9 is gone; messages to it are dropped until it reads again"
                ]
                bridge._socket.setsockopt(zmq.SNDHWM, 1)  # for the pipe the connect makes
                api.connect(address)
                await api.send(b"hello")
                assert await bridge._socket.recv_multipart() == [b"api-0", b"hello"]
                for _ in range(4096):  # the reader is not reading: its queue and the OS's buffers fill
                    bridge._send(b"api-0", b"y" * 4096)
                    if len(caplog.records) > 1:
                        break
                assert caplog.records[-1].getMessage() == (
                    "API server api-0 is not reading; messages to it are dropped until it reads again"
                )
                assert len(caplog.records) == 2
                assert await api.recv() == b"y" * 4096  # what was queued arrives
        finally:
            api.close()
            context.term()
            bridge.close()

    asyncio.run(run())
