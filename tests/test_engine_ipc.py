"""The engine core's "out" message (engine_ipc.py): a step's outputs go from the core's
StreamTable through its listener, msgpack and the API server's StreamTable into the streams the
client-facing code reads, which must then hold what one process's streams hold."""

from __future__ import annotations

import pytest

from protos.executor import StepOnlyExecutor
from protos.plan import ExecutorInfo, StepPlan, StepResult, TokenLogprobs
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
    ((engine_ids, num_tokens, token_ids, num_cached_tokens, details),) = sent
    assert (engine_ids, num_tokens, token_ids, num_cached_tokens) == (
        [1, 2, 3],
        [1, 1, 1],
        [7, 8, 0],
        [0, 0, 0],
    )
    assert details == [[2, None, None, True, "stop", None, None]]


def test_the_flat_token_column_splits_by_the_counts():
    """An "out" message carries every request's new tokens in one column, num_tokens each."""
    columns = ipc.unpack(ipc.pack("out", [1, 2, 3, 4], [2, 0, 1, 3], [7, 8, 9, 4, 5, 6], [16, 0, 0, 32], []))
    outputs, failures = ipc.outputs_from_wire(*columns[1:])
    assert [(o.request_id, o.new_token_ids, o.num_cached_tokens) for o in outputs] == [
        (1, [7, 8], 16),
        (2, [], 0),
        (3, [9], 0),
        (4, [4, 5, 6], 32),
    ]
    assert not failures
    with pytest.raises(ValueError, match="6 tokens by its counts carries 7"):
        ipc.outputs_from_wire([1, 2], [2, 4], [1, 2, 3, 4, 5, 6, 7], [0, 0], [])


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
                assert bridge._socket.poll(5000) and bridge._socket.recv_multipart() == [b"api-0", b"hello"]
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


def test_the_core_reads_every_message_while_it_sends(tmp_path):
    """The engine core's socket is read when the loop sees its descriptor readable, and ZeroMQ's
    descriptor is edge-triggered (a send can consume the signal of a message that arrived): with
    the core sending to an API server all the while, every message the API server sends is still
    handled, without waiting for a later one to wake the loop."""
    import asyncio
    from types import SimpleNamespace

    import zmq

    from scheduler_service.engine_core import CoreBridge

    engine = SimpleNamespace(
        streams=SimpleNamespace(listener=None),
        engine=None,
        not_connected_message=lambda: "not connected",
        admitting=True,
    )
    address = f"ipc://{tmp_path}/core"
    metrics = SchedulerMetrics()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        bridge = CoreBridge(engine, metrics, address)
        bridge.start(loop)
        context = zmq.Context()
        api = context.socket(zmq.DEALER)
        api.setsockopt(zmq.IDENTITY, b"api-0")
        api.setsockopt(zmq.LINGER, 0)
        api.connect(address)
        try:
            api.send(ipc.pack("hello"))
            for _ in range(100):  # until the core knows the API server
                await asyncio.sleep(0.01)
                if bridge.peers:
                    break
            assert bridge.peers == {b"api-0"}
            stop = False

            def keep_sending() -> None:  # the core's sends, as each step's would be
                if not stop:
                    bridge.broadcast_state()
                    loop.call_soon(keep_sending)

            keep_sending()
            for i in range(300):
                api.send(ipc.pack("metrics", [["prompt_tokens", [], "inc", 1]]))
                if i % 50 == 0:
                    await asyncio.sleep(0)
            for _ in range(200):
                await asyncio.sleep(0.01)
                if metrics.registry.get_sample_value("tandem_scheduler_prompt_tokens_total") == 300:
                    break
            stop = True
            assert metrics.registry.get_sample_value("tandem_scheduler_prompt_tokens_total") == 300
        finally:
            api.close()
            context.term()
            bridge.close()

    asyncio.run(run())


class _CountingExecutor(StepOnlyExecutor):
    """Samples (seq id + tokens so far) % 40 + 2 for each sequence whose prompt is computed."""

    def __init__(self) -> None:
        self.info = ExecutorInfo(
            model="counting", architecture="Counting", block_size=4, num_kv_blocks=256, max_model_len=128,
            vocab_size=64, eos_token_ids=[0], tensor_parallel_size=1, dtype="float32", device="cpu",
            max_num_seqs=8, max_num_batched_tokens=16, attention_backend="none", num_layers=1, block_bytes=1,
        )  # fmt: skip
        self.seqs: dict[int, list[int]] = {}  # seq id -> [tokens known, tokens computed]

    def describe(self) -> ExecutorInfo:
        return self.info

    def reset(self) -> int:
        self.seqs.clear()
        return 0

    def step(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_seq_ids + plan.preempted_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = [len(new.token_ids), new.num_computed_tokens]
        result = StepResult(step_id=plan.step_id)
        for seq_id, n in zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True):
            state = self.seqs[seq_id]
            state[1] += n
            if state[1] >= state[0]:
                token = (seq_id + state[0]) % 40 + 2
                result.seq_ids.append(seq_id)
                result.token_ids.append(token)
                result.num_tokens.append(1)
                result.logprobs.append(TokenLogprobs(seq_id, [-0.25 * token], [token], [-0.25 * token]))
                state[0] += 1
        return result


def test_the_engine_threads_out_messages_leave_what_the_general_path_leaves():
    """CoreBridge.step_outputs builds each step's "out" message on the engine thread from the
    sequences themselves (no RequestOutput, no dispatch on the loop). Through it, every API
    server's streams end as through the general path (RequestOutputs dispatched on the core's
    StreamTable, forwarded by its listener), over prefill chunks, stop tokens, length limits, a
    prefix hit and a request with logprobs (which RequestTracker leaves on the general path); the
    core's table is emptied and its queued prompt tokens drop to 0 either way, and TTFT is observed
    once per request."""
    from types import SimpleNamespace

    from scheduler_service.engine import LLMEngine
    from scheduler_service.engine_core import CoreBridge
    from scheduler_service.request_tracker import RequestTracker

    prompts = [list(range(2, 2 + n)) for n in (3, 21, 9, 21, 6)]  # the 4th repeats the 2nd
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=30, stop_token_ids=[25]),
        SamplingParams(max_tokens=7, logprobs=1),
        SamplingParams(max_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=40, stop_token_ids=[30]),
    ]
    peers = [b"api-0", b"api-1"]

    def run(fast: bool, address: str) -> tuple[list[RequestStream], dict, StreamTable, SchedulerMetrics]:
        metrics = SchedulerMetrics()
        core_streams = StreamTable(metrics)
        core = SimpleNamespace(streams=core_streams, step_outputs=None, call_soon=lambda f, *a: f(*a))
        bridge = CoreBridge(core, metrics, address)
        sent: list[tuple[bytes, bytes]] = []
        bridge._send_locked = lambda peer, frame: sent.append((peer, frame))
        api = {peer: StreamTable(SchedulerMetrics()) for peer in peers}
        api_streams = []
        engine = LLMEngine(_CountingExecutor())
        tracker = RequestTracker(core_streams, metrics, lambda outputs, failures: None)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            peer = peers[i % 2]
            stream = tracker.add(f"r{i}", prompt, p, 0.0, None, peer=peer if fast else None)
            bridge._remote[stream.engine_id] = (peer, stream)
            api_streams.append(RequestStream(f"r{i}", stream.engine_id, len(prompt), p, 0.0))
            api[peer].add(api_streams[-1])
        tracker.drain_into(engine)
        assert [seq.client is not None for seq in engine.scheduler.seqs.values()] == [
            fast,
            fast,
            False,
            fast,
            fast,
        ]
        aborted = next(s for s in core_streams._streams.values() if s.request_id == "r4")
        num_steps = 0
        try:
            while engine.has_unfinished_requests() or engine.scheduler.has_finished_to_send():
                num_steps += 1
                if num_steps == 12:  # its client goes away: no output of it reaches the API server after
                    tracker.abort(aborted)
                if num_steps == 14:  # (the engine takes the abort two steps later)
                    tracker.drain_into(engine)
                if fast:
                    bridge.step_outputs(engine.step_sequences())
                else:
                    core_streams.dispatch(engine.step(), None, 1.0)
                for peer, frame in sent:
                    kind, *columns = ipc.unpack(frame)
                    assert kind == "out"
                    api[peer].dispatch(*ipc.outputs_from_wire(*columns), 1.0)
                sent.clear()
        finally:
            bridge.close()
        return api_streams, api, core_streams, metrics

    general = run(False, ipc.ipc_address())
    fast = run(True, ipc.ipc_address())
    for _, api, core, metrics in (general, fast):
        assert len(core) == 0 and core.num_queued_tokens == 0
        assert [len(table) for table in api.values()] == [1, 0]  # r4's stream, never finished there
        (count,) = [s.value for s in metrics.ttft.collect()[0].samples if s.name.endswith("_count")]
        assert count == len(prompts)
    assert state(fast[0]) == state(general[0])
    reasons = [s.finish_reason for s in fast[0]]
    assert reasons == ["length", "stop", "length", "length", None], reasons
    assert 0 < len(fast[0][4].token_ids) < 40 and not fast[0][4].finished
    assert fast[0][3].num_cached_tokens > 0  # the prefix hit
    assert [lp.logprob for lp in fast[0][2].logprobs] == [-0.25 * t for t in fast[0][2].token_ids]


def test_a_failing_step_outputs_hook_leaves_the_steps_outputs_to_the_stream_table(caplog):
    """A bug in the engine core's step_outputs must not stop the engine thread or lose a token:
    the step's outputs then go through the stream table, and the request completes."""
    import asyncio
    import time

    from scheduler_service.async_engine import AsyncEngine
    from scheduler_service.config import EngineOptions, SchedulerConfig

    calls = []

    def broken(seqs) -> None:
        calls.append(len(seqs))
        raise RuntimeError("a bug in step_outputs")

    async def run() -> RequestStream:
        engine = AsyncEngine(_CountingExecutor(), EngineOptions(SchedulerConfig()), SchedulerMetrics())
        engine.step_outputs = broken
        engine.start(asyncio.get_running_loop())
        try:
            for _ in range(200):
                if engine.engine is not None:
                    break
                await asyncio.sleep(0.01)
            params = SamplingParams(max_tokens=6, ignore_eos=True)
            stream = engine.add_request("r", [2, 3, 4, 5], params, time.perf_counter())
            await asyncio.wait_for(stream.wait(6), 10)
            return stream
        finally:
            await engine.aclose()

    stream = asyncio.run(run())
    assert calls and len(stream.token_ids) == 6 and stream.finished and stream.finish_reason == "length"
    assert "step_outputs failed" in caplog.text


@pytest.mark.parametrize("answered_first", [True, False])
def test_a_caller_gone_when_the_core_admits_its_request_aborts_it(monkeypatch, answered_first):
    """An API server's submit() is cancelled (a gRPC client cancels, say) in the instant the core
    admits the request: before the core's answer (`answered_first` False), or once it has arrived
    but before the caller has run again. Either way the samples the core admitted are aborted
    there, not left generating for nobody, and the table here holds none of them."""
    import asyncio

    from scheduler_service import api_server
    from scheduler_service.api_server import MetricsRelay, RemoteEngine

    monkeypatch.setattr(api_server, "validate_request", lambda *args: None)

    async def main() -> tuple[list[tuple], int]:
        remote = RemoteEngine("tcp://127.0.0.1:9", "api-test", MetricsRelay())
        sent: list[tuple] = []
        remote._send = lambda *message: sent.append(message)
        remote.check_admitting = lambda: api_server.EngineView(None, None)
        try:
            submit = asyncio.ensure_future(remote.submit("req", [1, 2, 3], SamplingParams(n=2), 0.0))
            await asyncio.sleep(0)  # it sent "add" and waits for the core's answer
            key = sent[-1][1]
            if answered_first:
                remote._on_added(key, [7, 8])  # the core admitted it: the caller is woken...
                submit.cancel()  # ...but cancelled before it runs
            else:
                submit.cancel()
                await asyncio.sleep(0)
                remote._on_added(key, [7, 8])
            with pytest.raises(asyncio.CancelledError):
                await submit
            return [m for m in sent if m[0] == "abort"], len(remote.streams)
        finally:
            remote._socket.close()
            remote._context.term()

    aborts, left = asyncio.run(main())
    assert sorted(aborts) == [("abort", 7), ("abort", 8)]
    assert left == 0


def test_a_request_that_cannot_be_sent_to_the_core_leaves_no_admission_pending(monkeypatch):
    """A submit() whose "add" message cannot be sent (here: a string msgpack cannot encode) fails
    without leaving its admission pending: a pending one is never answered, and the API server's
    graceful shutdown waited for it through all of --shutdown-timeout."""
    import asyncio

    from scheduler_service import api_server
    from scheduler_service.api_server import MetricsRelay, RemoteEngine

    monkeypatch.setattr(api_server, "validate_request", lambda *args: None)

    async def main() -> int:
        remote = RemoteEngine("tcp://127.0.0.1:9", "api-test", MetricsRelay())
        remote._send = lambda *message: ipc.pack(*message)
        remote.check_admitting = lambda: api_server.EngineView(None, None)
        try:
            with pytest.raises(UnicodeEncodeError):
                await remote.submit("req", [1, 2, 3], SamplingParams(), 0.0, user="\ud800")
            return remote.num_pending_admissions
        finally:
            remote._socket.close()
            remote._context.term()

    assert asyncio.run(main()) == 0


def test_the_cores_answer_to_an_add_leaves_before_the_requests_first_out(tmp_path):
    """The engine thread may step a request the moment the core queues it, before the core has
    answered the API server's "add"; the API server drops an "out" for an engine id no "added" has
    named yet, so such a step's first tokens were lost (a split run streamed a prompt without its
    first two tokens). Here the engine thread steps inside the core's add: its "out" still
    follows the "added"."""
    import threading
    from types import SimpleNamespace

    from scheduler_service.engine_core import CoreBridge
    from scheduler_service.sequence import SequenceStatus

    peer = b"api-0"
    stepped: list[threading.Thread] = []

    def step(stream: RequestStream) -> None:  # the engine thread's step, the request's first token
        seq = SimpleNamespace(
            client=stream, error=None, seq_id=stream.engine_id, num_new_tokens=1, token_ids=[1, 2, 3, 9],
            num_cached_tokens=0, status=SequenceStatus.RUNNING, finish_reason=None,
        )  # fmt: skip
        bridge.step_outputs([seq])

    def add_requests(request_id, prompt, params, arrival, timeout, user, peer_):
        stream = RequestStream(request_id, 7, len(prompt), params, arrival, 0, peer_)
        thread = threading.Thread(target=step, args=(stream,))
        thread.start()
        thread.join(0.2)  # the engine thread had time to step (and, unordered, to send)
        stepped.append(thread)
        return [stream]

    engine = SimpleNamespace(
        streams=SimpleNamespace(listener=None), add_requests=add_requests, call_soon=lambda f, *a: None
    )
    bridge = CoreBridge(engine, SchedulerMetrics(), f"ipc://{tmp_path}/core")
    sent: list[tuple[bytes, list]] = []
    bridge._send_locked = lambda to, frame: sent.append((to, ipc.unpack(frame)))
    try:
        add = ipc.pack("add", 1, "req", [1, 2, 3], ipc.params_to_wire(SamplingParams()), 0.0, None, None)
        bridge._handle(peer, ipc.unpack(add))
        stepped[0].join(5)
        assert not stepped[0].is_alive()
    finally:
        bridge.close()
    assert [(to, message[0]) for to, message in sent] == [(peer, "added"), (peer, "out")]
    assert sent[0][1][1:] == [1, [7]]
    assert sent[1][1][1] == [7] and sent[1][1][3] == [9]  # the engine id, its first token
