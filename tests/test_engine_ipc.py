"""The engine core's "out" message (engine_ipc.py): a step's news for an API server's streams,
from the core's RequestStreams through msgpack to the outputs the API server dispatches."""

from __future__ import annotations

from scheduler_service import engine_ipc as ipc
from scheduler_service.errors import ErrorCode, TandemRequestError
from scheduler_service.request_stream import RequestStream
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.sequence import TokenLogprob


def stream(engine_id: int, token_ids: list[int], num_cached_tokens: int = 0) -> RequestStream:
    s = RequestStream(f"req-{engine_id}", engine_id, 5, SamplingParams(), arrival=0.0)
    s.token_ids = list(token_ids)
    s.num_cached_tokens = num_cached_tokens
    return s


def round_trip(streams: list[RequestStream]):
    frame = ipc.pack("out", *ipc.outputs_to_wire(streams))
    kind, *columns = ipc.unpack(frame)
    assert kind == "out"
    return ipc.outputs_from_wire(*columns)


def test_tokens_logprobs_finish_and_failure_survive_the_wire():
    plain = stream(1, [7, 8], num_cached_tokens=16)
    with_logprobs = stream(2, [9])
    with_logprobs.logprobs = [TokenLogprob(9, -0.5, [(9, -0.5), (3, -1.5)])]
    with_logprobs.prompt_logprobs = [TokenLogprob(4, -2.0, [(4, -2.0)], rank=1)]
    finished = stream(3, [0])
    finished.finished, finished.finish_reason = True, "stop"
    failed = stream(4, [5])
    failed.fail(TandemRequestError("step 9 failed", ErrorCode.INTERNAL))

    outputs, failures = round_trip([plain, with_logprobs, finished, failed])

    assert [o.request_id for o in outputs] == [1, 2, 3]
    first, second, third = outputs
    assert (first.new_token_ids, first.num_cached_tokens, first.finished) == ([7, 8], 16, False)
    assert first.new_logprobs is None and first.prompt_logprobs is None
    assert second.new_logprobs == [TokenLogprob(9, -0.5, [(9, -0.5), (3, -1.5)])]
    assert second.prompt_logprobs == [TokenLogprob(4, -2.0, [(4, -2.0)], rank=1)]
    assert (third.new_token_ids, third.finished, third.finish_reason) == ([0], True, "stop")
    assert list(failures) == [4]
    assert failures[4].code is ErrorCode.INTERNAL and failures[4].message == "step 9 failed"
    assert all(o.error is None for o in outputs)


def test_the_news_is_taken_from_the_streams_once():
    s = stream(1, [7])
    s.logprobs = [TokenLogprob(7, -0.1, [])]
    s.prompt_logprobs = [TokenLogprob(2, -1.0, [], rank=3)]
    round_trip([s])
    assert s.token_ids == [] and s.logprobs == [] and s.prompt_logprobs is None
    s.token_ids = [8]
    (output,), failures = round_trip([s])
    assert output.new_token_ids == [8] and output.prompt_logprobs is None and not failures


def test_empty_logprobs_are_sent_as_none():
    s = stream(1, [7])
    s.prompt_logprobs = []  # a one-token prompt scores nothing
    (output,), _ = round_trip([s])
    assert output.prompt_logprobs is None and output.new_logprobs is None
