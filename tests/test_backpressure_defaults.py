"""Backpressure is on out of the box: a scheduler given no --max-queue / --max-queued-tokens still
refuses early, with RESOURCE_EXHAUSTED naming the limit, instead of queueing without end.

The in-process test runs over a fake executor whose first step blocks until the test lets it go,
so the queue fills without any model compute: a thousand requests take a second or two."""

from __future__ import annotations

import argparse
import threading
import time

import grpc
import pytest
from helpers.scheduler_server import request, wait_serving

from protos.executor import StepOnlyExecutor
from protos.plan import ExecutorInfo, StepPlan, StepResult
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from scheduler_service import cli
from scheduler_service.async_engine import EngineOptions
from scheduler_service.config import DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUED_TOKENS, SchedulerConfig
from scheduler_service.executor_client import PlanRejected
from scheduler_service.server import SchedulerServer, ServerThread

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_defaults_are_finite_and_the_cli_passes_them_on(monkeypatch):
    assert 0 < DEFAULT_MAX_QUEUE < 10**6 and 0 < DEFAULT_MAX_QUEUED_TOKENS < 10**9
    options = EngineOptions(SchedulerConfig())
    assert (options.max_queue, options.max_queued_tokens) == (DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUED_TOKENS)
    # 0 still means no limit, in the options and on the command line.
    assert EngineOptions(SchedulerConfig(), max_queue=0, max_queued_tokens=0).max_queue is None

    built: list[EngineOptions] = []

    class Captured(Exception):
        pass

    def fake_server(executor, options, **kwargs):
        built.append(options)
        raise Captured

    from scheduler_service import server

    monkeypatch.setattr(server, "SchedulerServer", fake_server)
    for name in ("MAX_QUEUE", "MAX_QUEUED_TOKENS"):
        monkeypatch.delenv(f"TANDEM_{name}", raising=False)

    def options_for(*flags: str) -> EngineOptions:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        with pytest.raises(Captured):
            cli.run(parser.parse_args(["--executor", "127.0.0.1:1", "--metrics-port", "0", *flags]))
        return built.pop()

    unconfigured = options_for()
    assert (unconfigured.max_queue, unconfigured.max_queued_tokens) == (
        DEFAULT_MAX_QUEUE,
        DEFAULT_MAX_QUEUED_TOKENS,
    )
    off = options_for("--max-queue", "0", "--max-queued-tokens", "0")
    assert (off.max_queue, off.max_queued_tokens) == (None, None)
    # The environment twin is the same path as the flag.
    monkeypatch.setenv("TANDEM_MAX_QUEUE", "7")
    assert options_for().max_queue == 7
    # The help names the defaults.
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert f"default {DEFAULT_MAX_QUEUE}; 0 = no limit" in text
    assert f"default {DEFAULT_MAX_QUEUED_TOKENS}; 0 = no limit" in text


class BlockedExecutor(StepOnlyExecutor):
    """Describes a roomy executor; every step waits for `go`, then is rejected (INVALID_ARGUMENT),
    which fails only the requests in it."""

    def __init__(self) -> None:
        self.stepping = threading.Event()
        self.go = threading.Event()

    def describe(self) -> ExecutorInfo:
        return ExecutorInfo(
            model="blocked",
            architecture="Qwen3ForCausalLM",
            block_size=16,
            num_kv_blocks=4096,
            max_model_len=4096,
            vocab_size=512,
            eos_token_ids=[0],
            tensor_parallel_size=1,
            dtype="float32",
            device="cpu",
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            attention_backend="torch",
            num_layers=1,
            block_bytes=1024,
        )

    def reset(self) -> int:
        return 0

    def step(self, plan: StepPlan) -> StepResult:
        self.stepping.set()
        self.go.wait(60)
        raise PlanRejected("blocked:1", plan.step_id, "the test is over")


def test_an_unconfigured_scheduler_refuses_past_its_default_limits():
    """One request runs (its step blocks); then long prompts fill the queued-token limit and short
    ones the request limit, both at their defaults. A batch of one keeps the numbers small."""
    long_prompt = 1100
    # Requests of `long_prompt` tokens admitted before the next would exceed the token limit
    # (the running one counts: it has no output yet).
    n_long = DEFAULT_MAX_QUEUED_TOKENS // long_prompt
    # Then one-token requests until DEFAULT_MAX_QUEUE wait beyond the one running.
    n_short = DEFAULT_MAX_QUEUE - (n_long - 1)
    assert 0 < n_short <= DEFAULT_MAX_QUEUED_TOKENS - n_long * long_prompt

    executor = BlockedExecutor()
    server = SchedulerServer(executor, EngineOptions(SchedulerConfig(max_num_seqs=1)), port=0)
    calls = []
    with ServerThread(server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            wait_serving(channel)
            stub = pb_grpc.GenerationServiceStub(channel)

            def admitted(n: int, timeout: float = 60.0) -> None:
                deadline = time.monotonic() + timeout
                while len(server.engine.streams) < n:
                    for call in calls:  # none may have ended (been refused)
                        assert not call.done(), (call.code(), call.details())
                    assert time.monotonic() < deadline, f"{len(server.engine.streams)} of {n} admitted"
                    time.sleep(0.02)
                assert len(server.engine.streams) == n

            def refused(prompt: list[int]) -> str:
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(request(prompt, max_tokens=1), timeout=10))
                assert e.value.code() == RESOURCE_EXHAUSTED, e.value.details()
                return e.value.details()

            prompt = [3] * long_prompt
            calls.append(stub.Generate(request(prompt, max_tokens=1)))
            assert executor.stepping.wait(20), "the first request was never scheduled"
            calls += [stub.Generate(request(prompt, max_tokens=1)) for _ in range(n_long - 1)]
            admitted(n_long)
            details = refused(prompt)
            assert f"--max-queued-tokens {DEFAULT_MAX_QUEUED_TOKENS}" in details, details
            assert f"{n_long * long_prompt} prompt tokens waiting" in details, details

            calls += [stub.Generate(request([4], max_tokens=1)) for _ in range(n_short)]
            admitted(n_long + n_short)
            details = refused([4])
            assert f"--max-queue {DEFAULT_MAX_QUEUE}" in details, details
            assert f"{DEFAULT_MAX_QUEUE} requests waiting" in details, details
        finally:
            for call in calls:
                call.cancel()
            executor.go.set()
            channel.close()
