"""Requests that could exhaust the scheduler are refused or bounded, and the service keeps serving
(issue 13, items 3-5): a text prompt too large to fit max_model_len is refused before it is
tokenized while health checks stay answered; logprobs are capped by --max-logprobs; a slow reader's
pending tokens go out in chunks under the message limit; every request that ends badly is counted.
The services are real processes serving the shipped tiny model, except where noted."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from helpers.processes import CHILD_ENV, ROOT
from helpers.scheduler_server import NUM_KV_BLOCKS, metrics, request, wait_serving
from helpers.services import Services

from client import TandemClient, TandemError
from client.llm import LLM
from executor_service.config import ExecutorConfig
from executor_service.executor import LocalExecutor
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc
from scheduler_service.async_engine import EngineOptions
from scheduler_service.config import SchedulerConfig
from scheduler_service.sampling_params import InvalidRequestError, SamplingParams
from scheduler_service.server import SchedulerServer, ServerThread
from scheduler_service.tokenizer import Tokenizer

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

# The scheduler's gRPC limit, each way.
MAX_MESSAGE_BYTES = 16 * 2**20
MODEL = ROOT / "models" / "tandem-tiny-pydoc"
# The tiny model's max_model_len is 2,048 and its longest token 107 bytes: any text over 219 KB.
HUGE_TEXT = "The list type " * (15 * 2**20 // 14)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    services = Services(MODEL, tmp_path_factory.mktemp("limits_logs"))
    try:
        services.start()
        yield services
    finally:
        services.stop()


def test_the_bound_never_exceeds_the_real_token_count():
    tokenizer = Tokenizer(MODEL)
    assert tokenizer.max_bytes_per_token == 107
    for text in (
        "a",
        "The list type",
        "\u00e9t\u00e9 \u4e2d\u6587",
        "<|endoftext|>" * 5,
        " " * 5000,
        "x" * 3000,
    ):
        assert 0 < tokenizer.min_num_tokens(text) <= len(tokenizer.encode(text)), text


def test_a_15_mib_text_prompt_is_refused_at_once_while_health_stays_answered(services):
    rss_before = _rss_bytes(services.scheduler.process.pid)
    latencies: list[float] = []
    refused = threading.Event()

    def refuse() -> None:
        try:
            with TandemClient(services.address) as client:
                for _ in range(3):  # three of them took 47 s and 4.4 GB
                    with pytest.raises(TandemError) as e:
                        client.complete(HUGE_TEXT, max_tokens=16)
                    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value.message
                    assert "exceeds max_model_len (2048)" in e.value.message
                    assert "at least" in e.value.message
        finally:
            refused.set()

    with TandemClient(services.address) as client, ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        refusing = pool.submit(refuse)
        while not refused.is_set():
            t0 = time.monotonic()
            assert client.health(timeout=5.0) == "SERVING"
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
        refusing.result()
        elapsed = time.monotonic() - start
        # Another stream is served right after.
        assert client.complete("The list type", max_tokens=8, ignore_eos=True).completion_tokens == 8
    assert elapsed < 10.0, f"three refusals took {elapsed:.1f} s"
    assert max(latencies) < 1.0, f"health took up to {max(latencies) * 1000:.0f} ms"
    growth = _rss_bytes(services.scheduler.process.pid) - rss_before
    assert growth < 300 * 2**20, f"scheduler RSS grew {growth / 2**20:.0f} MiB"


def test_logprobs_over_max_logprobs_is_invalid_argument_naming_it(services):
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from client.cli import main; sys.exit(main(sys.argv[1:]))"]
        + ["generate", "--server", services.address, "The list type"]
        + ["--logprobs", "300", "--timeout", "30"],
        env=CHILD_ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "INVALID_ARGUMENT" in done.stderr, done.stderr
    assert "logprobs (300) exceeds max_logprobs (20; the scheduler's --max-logprobs)" in done.stderr
    with TandemClient(services.address) as client:
        assert client.model_info().max_logprobs == 20
        ok = client.complete("The list type", max_tokens=4, logprobs=20, ignore_eos=True)
        assert [len(lp.top_logprobs) for lp in ok.logprobs] == [20] * 4


def test_logprob_memory_is_bounded_and_returned(services):
    pid = services.scheduler.process.pid
    with TandemClient(services.address) as client:
        client.complete("The list type", max_tokens=8, logprobs=20)  # warm up
        rss_before = _rss_bytes(pid)
        with ThreadPoolExecutor(4) as pool:
            list(
                pool.map(
                    lambda _: client.complete("Exceptions", max_tokens=500, logprobs=20, ignore_eos=True),
                    range(4),
                )
            )
    growth = _rss_bytes(pid) - rss_before
    assert growth < 200 * 2**20, f"scheduler RSS grew {growth / 2**20:.0f} MiB"  # 1.7 GB at 4096


def test_the_in_process_llm_honours_max_logprobs():
    llm = LLM(str(MODEL), num_kv_blocks=128, max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match=r"logprobs \(300\) exceeds max_logprobs \(20"):
        llm.generate(["The list type"], SamplingParams(max_tokens=4, logprobs=300), use_tqdm=False)
    out = llm.generate(["The list type"], SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)[0]
    assert len(out.logprobs) == 2


# -- an in-process scheduler, with logprobs up to the vocabulary ------------------------------------


@pytest.fixture(scope="module")
def wide():
    executor = LocalExecutor(ExecutorConfig(model=str(MODEL), num_kv_blocks=NUM_KV_BLOCKS))
    config = SchedulerConfig(max_num_seqs=8)
    config.max_logprobs = 4096  # (set after construction: also runs where there is no such limit)
    options = EngineOptions(config)
    tokenizer = Tokenizer(MODEL)
    server = SchedulerServer(executor, options, tokenizer_for=lambda info: tokenizer, port=0, metrics_port=0)
    thread = ServerThread(server)
    thread.start()
    channel = grpc.insecure_channel(
        f"127.0.0.1:{server.port}",
        options=[
            ("grpc.max_send_message_length", 64 * 2**20),
            ("grpc.max_receive_message_length", 64 * 2**20),
        ],
    )
    wait_serving(channel)
    yield server, channel
    channel.close()
    thread.stop()


def test_a_slow_readers_pending_tokens_go_out_in_chunks_under_the_limit(wide):
    server, channel = wide
    num_tokens = 600  # x 4,096 logprobs: about 41 KiB a token, 24 MiB in all
    stub = pb_grpc.GenerationServiceStub(channel)
    before = metrics(server)
    responses = stub.Generate(
        request([5, 6, 7], max_tokens=num_tokens, ignore_eos=True, logprobs=4096), timeout=120
    )
    first = next(responses)
    generated = ("tandem_scheduler_generation_tokens_total",)
    deadline = time.monotonic() + 100
    while metrics(server)[generated] - before[generated] < num_tokens:  # the reader pauses meanwhile
        assert time.monotonic() < deadline
        time.sleep(0.2)
    rest = list(responses)
    chunks = [r.chunk for r in [first, *rest] if r.WhichOneof("payload") == "chunk"]
    assert rest[-1].final.completion_tokens == num_tokens
    assert sum(len(c.token_ids) for c in chunks) == sum(len(c.logprobs) for c in chunks) == num_tokens
    assert all(len(lp.top_logprobs) == 4096 for c in chunks for lp in c.logprobs)
    sizes = [r.ByteSize() for r in rest]
    # Under the 4 MiB a default gRPC client (grpcurl, Go, Java) accepts.
    assert max(sizes) <= 4 * 2**20 and len(rest) >= 3, sizes


def test_a_request_over_the_message_limit_is_counted(wide):
    server, channel = wide
    code = ("tandem_scheduler_requests_failed_total", ("code", "RESOURCE_EXHAUSTED"))
    before = metrics(server).get(code, 0)
    stub = pb_grpc.GenerationServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="x" * (MAX_MESSAGE_BYTES + 1024)), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    deadline = time.monotonic() + 5
    while metrics(server).get(code, 0) != before + 1:
        assert time.monotonic() < deadline, "the refused request was not counted"
        time.sleep(0.05)
    after = list(stub.Generate(request([5], max_tokens=2, ignore_eos=True), timeout=30))
    assert after[-1].final.completion_tokens == 2


def test_a_long_text_is_tokenized_without_holding_up_other_threads():
    """A prompt that passes the size bound (a larger max_model_len, or a tokenizer without a bound)
    is tokenized in a thread: the thread must release the GIL, or the event loop, and with it
    health checks and every stream, stops until it is done."""
    tokenizer = Tokenizer(MODEL)
    text = "The list type is mutable. " * (3 * 2**20 // 26)
    gaps: list[float] = []
    done = threading.Event()

    def tick():
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.monotonic()
    ids = tokenizer.encode_off_gil(text)
    took = time.monotonic() - t0
    done.set()
    ticker.join()
    assert ids[:50] == tokenizer.encode(text[:300])[:50]
    assert took > 0.3, f"too short a text to tell: {took:.2f} s"
    assert max(gaps) < took / 2, f"the ticker stalled {max(gaps):.2f} s of the {took:.2f} s"


def test_the_size_bound_gives_up_where_one_token_can_cover_any_length(tmp_path):
    """An added token that strips whitespace around it, or BPE that fuses unknown characters, can
    stand for any number of bytes: no bound then (a prompt that fits must never be refused)."""
    import json

    spec = json.loads((MODEL / "tokenizer.json").read_text())
    spec["added_tokens"].append(
        {"id": len(spec["model"]["vocab"]) + 10, "content": "<mask>", "single_word": False, "lstrip": True,
         "rstrip": False, "normalized": False, "special": True}
    )  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    stripping = Tokenizer(tmp_path)
    assert stripping.max_bytes_per_token is None and stripping.min_num_tokens(" " * 20000 + "<mask>") == 0
    assert len(stripping.encode(" " * 20000 + "<mask>")) < 5
    assert Tokenizer(MODEL).max_bytes_per_token == 107
