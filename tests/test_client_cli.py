"""The client library and the `tandem` CLI without the real services: argument parsing, the mapping
of keyword arguments to generation.proto, and the clients against a fake GenerationService."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client import AsyncTandemClient, Chunk, Final, TandemClient, TandemError, cli, up
from client.defaults import DEFAULT_MODEL, DEFAULT_SERVER, free_port
from client.messages import generate_request, sampling_params
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]


# --- kwargs -> proto ------------------------------------------------------------------------


def test_every_sampling_kwarg_maps_to_its_proto_field():
    sp = sampling_params(
        max_tokens=7,
        temperature=0.5,
        top_k=3,
        top_p=0.9,
        min_p=0.1,
        seed=42,
        stop=["\n\n", "."],
        stop_token_ids=[5, 6],
        ignore_eos=True,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.4,
        logprobs=2,
        n=3,
        min_tokens=2,
        logit_bias={42: 100, 7: -0.5},
        prompt_logprobs=0,
        include_stop_str_in_output=True,
    )
    assert sp.max_tokens == 7 and sp.top_k == 3 and sp.seed == 42 and sp.logprobs == 2
    assert sp.n == 3 and sp.min_tokens == 2 and dict(sp.logit_bias) == {42: 100.0, 7: -0.5}
    assert sp.HasField("prompt_logprobs") and sp.prompt_logprobs == 0 and sp.include_stop_str_in_output
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    assert sp.min_p == pytest.approx(0.1) and sp.repetition_penalty == pytest.approx(1.2)
    assert sp.presence_penalty == pytest.approx(0.3) and sp.frequency_penalty == pytest.approx(0.4)
    assert list(sp.stop) == ["\n\n", "."] and list(sp.stop_token_ids) == [5, 6] and sp.ignore_eos


def test_special_token_and_truncation_kwargs_map_to_their_proto_fields():
    """skip_special_tokens, spaces_between_special_tokens and truncate_prompt_tokens are keyword
    arguments of the client as of SamplingParams; unset, the server applies its defaults (true,
    true, no truncation); false and 0 are sent as set (0 for the server to refuse, naming it)."""
    sp = sampling_params(
        skip_special_tokens=False, spaces_between_special_tokens=False, truncate_prompt_tokens=-1
    )
    assert sp.HasField("skip_special_tokens") and not sp.skip_special_tokens
    assert sp.HasField("spaces_between_special_tokens") and not sp.spaces_between_special_tokens
    assert sp.HasField("truncate_prompt_tokens") and sp.truncate_prompt_tokens == -1
    assert sampling_params(truncate_prompt_tokens=0).HasField("truncate_prompt_tokens")
    unset = sampling_params()
    assert not any(
        unset.HasField(f)
        for f in ("skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens")
    )
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be in"):
        sampling_params(truncate_prompt_tokens=2**31)


def test_unset_kwargs_leave_the_server_defaults():
    sp = sampling_params(top_p=None, seed=None, max_tokens=4)
    # Optional fields stay unset, so the server applies "1 = disabled" and "no seed".
    assert not sp.HasField("top_p") and not sp.HasField("seed") and not sp.HasField("repetition_penalty")
    assert sp.max_tokens == 4
    # seed 0 is a seed, not "unset".
    assert sampling_params(seed=0).HasField("seed")


def test_a_single_stop_string_is_a_list_of_one():
    assert list(sampling_params(stop="END").stop) == ["END"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_token": 3}, "unknown sampling argument"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"max_tokens": True}, "max_tokens must be an integer"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"logit_bias": {"a": 1}}, "logit_bias keys must be token ids"),
    ],
)
def test_bad_kwargs_fail_before_anything_is_sent(kwargs, message):
    with pytest.raises(TypeError, match=message):
        sampling_params(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 2**31}, r"max_tokens must be in \[-2147483648, 2147483647\], got 2147483648"),
        ({"n": -(2**31) - 1}, r"n must be in \[-2147483648, 2147483647\]"),
        ({"seed": 2**64}, r"seed must be in \[-2\*\*63, 2\*\*64\), got 18446744073709551616"),
        ({"seed": -(2**63) - 1}, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
        ({"stop_token_ids": [1, 2**31]}, r"stop_token_ids\[1\] must be in \[-2147483648, 2147483647\]"),
        ({"logit_bias": {2**40: 1.0}}, r"logit_bias token id must be in \[-2147483648, 2147483647\]"),
    ],
)
def test_integers_past_the_protos_fields_are_refused_naming_the_argument(kwargs, message):
    """protobuf's own error named only the value ("Value out of range: 2147483648"), and
    `tandem generate --max-tokens 99999999999` was a traceback of it."""
    with pytest.raises(ValueError, match=message):
        sampling_params(**kwargs)


def test_n_0_is_refused_rather_than_sent_as_one_sample(capsys):
    """The proto's n = 0 means unset (one sample): `n=0` (`tandem generate --n 0`) ran one sample,
    where the offline LLM and the HTTP API refuse it."""
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        sampling_params(n=0)
    assert sampling_params(n=1).n == 1
    argv = ["generate", "--server", f"127.0.0.1:{free_port()}", "--retries", "0", "--n", "0", "x"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "n must be >= 1, got 0" in err and "no tandem server" not in err


def test_a_negative_seed_travels_modulo_2_64_as_offline():
    assert sampling_params(seed=-2).seed == 2**64 - 2
    assert not sampling_params(seed=-1).HasField("seed")  # vLLM's "no seed", as offline
    assert sampling_params(seed=-(2**63)).seed == 2**63


def test_a_prompt_token_id_past_int32_is_refused_naming_its_position(capsys):
    with pytest.raises(
        ValueError, match=r"prompt token id at position 1 must be in \[-2147483648, 2147483647\]"
    ):
        generate_request([1, 2**31])
    address = f"127.0.0.1:{free_port()}"  # nothing is sent: no server needed
    for flags in (["x", "--max-tokens", "99999999999"], ["--prompt-ids", "99999999999"]):
        assert cli.main(["generate", "--server", address, "--retries", "0", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "must be in [-2147483648, 2147483647]" in err
        assert "Traceback" not in err
    import io

    from client.chat import run_chat

    argv = ["chat", "--server", address, "--max-tokens", "99999999999"]
    assert (
        run_chat(cli.build_parser(argv).parse_args(argv), stdin=io.StringIO("hi\n"), out=io.StringIO()) == 2
    )
    assert "max_tokens must be in [-2147483648, 2147483647]" in capsys.readouterr().err


def test_prompt_is_text_or_token_ids():
    assert generate_request("hello").WhichOneof("prompt") == "text"
    request = generate_request([1, 2, 3], request_id="r1", max_tokens=2)
    assert request.WhichOneof("prompt") == "token_ids" and list(request.token_ids.ids) == [1, 2, 3]
    assert request.request_id == "r1" and request.sampling_params.max_tokens == 2
    with pytest.raises(TypeError, match="token ids"):
        generate_request([1, "2"])


# --- CLI parsing ----------------------------------------------------------------------------


def parse(*argv: str):
    return cli.build_parser(list(argv)).parse_args(list(argv))


def test_generate_defaults_to_the_local_server(monkeypatch):
    monkeypatch.delenv("TANDEM_SERVER", raising=False)
    args = parse("generate", "The list type")
    assert args.model is None and cli.server_address(args) == DEFAULT_SERVER
    assert cli.prompts_of(args) == ["The list type"]
    monkeypatch.setenv("TANDEM_SERVER", "10.0.0.1:6000")
    assert cli.server_address(parse("generate", "x")) == "10.0.0.1:6000"
    assert cli.server_address(parse("generate", "x", "--server", "h:1")) == "h:1"


def test_server_and_model_are_mutually_exclusive(capsys):
    with pytest.raises(SystemExit):
        parse("generate", "x", "--server", "h:1", "--model", "m")
    assert "not allowed with" in capsys.readouterr().err


def test_prompts_positional_flags_and_ids():
    args = parse("generate", "a", "b", "--prompt", "c")
    assert cli.prompts_of(args) == ["a", "b", "c"]
    assert cli.prompts_of(parse("generate", "--prompt-ids", "1,2", "--prompt-ids", "3")) == [[1, 2], [3]]
    with pytest.raises(ValueError, match="not both"):
        cli.prompts_of(parse("generate", "a", "--prompt-ids", "1"))
    with pytest.raises(ValueError, match="no prompt"):
        cli.prompts_of(parse("generate"))


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1", ""])
def test_prompt_ids_with_an_empty_item_are_refused(ids, capsys):
    """An empty item was dropped ("1,,2" ran as [1, 2], "" as an empty prompt): a typo'd id list
    is not the prompt the user wrote."""
    with pytest.raises(SystemExit) as e:
        parse("generate", f"--prompt-ids={ids}")
    assert e.value.code == 2
    assert f"--prompt-ids takes comma-separated integers, got {ids!r}" in capsys.readouterr().err
    assert cli.prompts_of(parse("generate", "--prompt-ids", " 1, 2 ")) == [[1, 2]]


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_refused(timeout, capsys):
    """--timeout 0 (or negative, NaN) failed every call at once with DEADLINE_EXCEEDED, which the
    CLI reported as "no tandem server at ...": a server that was there was said not to be."""
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
        TandemClient("127.0.0.1:1", timeout=float(timeout))
    with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds"):
        asyncio.run(_async_client(timeout=float(timeout)))
    argv = ["generate", "--server", f"127.0.0.1:{free_port()}", "x", "--timeout", timeout]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "timeout must be a positive, finite number of seconds" in err and "no tandem server" not in err


@pytest.mark.parametrize("port", ["0", "-5", "65536", "99999"])
def test_a_server_port_outside_1_65535_is_refused(port, capsys):
    """gRPC takes a port modulo 2**16: `--server 127.0.0.1:99999` was "no tandem server at
    127.0.0.1:99999 (... ipv4:127.0.0.1:34463: Failed to connect ...)", naming a port never given."""
    message = f"port must be in [1, 65535], got {port}"
    with pytest.raises(ValueError, match=re.escape(message)):
        TandemClient(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match=re.escape(message)):
        asyncio.run(_async_client(address=f"[::1]:{port}"))
    assert cli.main(["generate", "--server", f"127.0.0.1:{port}", "--retries", "0", "x"]) == 2
    err = capsys.readouterr().err
    assert message in err and "no tandem server" not in err
    for target in ("dns:///127.0.0.1:50051", "[::1]:50051", "unix:/tmp/tandem.sock", "localhost"):
        TandemClient(target).close()


async def _async_client(address: str = "127.0.0.1:1", **kwargs) -> None:
    AsyncTandemClient(address, **kwargs)


def test_sampling_flags_become_kwargs():
    args = parse(
        "generate", "x", "--max-tokens", "9", "--stop", "\n", "--stop", "END", "--stop-token-id", "3",
        "--top-p", "0.5", "--seed", "1", "--ignore-eos", "--logprobs", "2",
    )  # fmt: skip
    assert cli.sampling_kwargs(args) == {
        "max_tokens": 9,
        "temperature": 0.0,
        "top_p": 0.5,
        "seed": 1,
        "stop": ["\n", "END"],
        "stop_token_ids": [3],
        "ignore_eos": True,
        "logprobs": 2,
    }
    # Unset flags are left to the server (or to SamplingParams in-process).
    assert cli.sampling_kwargs(parse("generate", "x")) == {"max_tokens": 16, "temperature": 0.0}
    args = parse("generate", "x", "--no-skip-special-tokens", "--truncate-prompt-tokens", "-1")
    assert cli.sampling_kwargs(args) == {
        "max_tokens": 16,
        "temperature": 0.0,
        "skip_special_tokens": False,
        "truncate_prompt_tokens": -1,
    }


def test_a_bad_client_twin_is_a_usage_error_of_its_own_command(monkeypatch, capsys):
    """TANDEM_RETRIES and TANDEM_HTTP_PORT that are no integers: argparse's error for the command
    that reads them (exit 2), not a traceback of every `tandem` command (--help included)."""
    for twin, argv, flag, other in (
        ("TANDEM_RETRIES", ("generate", "x"), "--retries", ("up",)),
        ("TANDEM_HTTP_PORT", ("up",), "--http-port", ("generate", "x")),
    ):
        monkeypatch.setenv(twin, "abc")
        parse(*other)  # a command that does not read it is unaffected
        with pytest.raises(SystemExit) as e:
            parse(*argv)
        assert e.value.code == 2
        assert f"argument {flag}: invalid int value: 'abc'" in capsys.readouterr().err
        monkeypatch.delenv(twin)


def test_verb_detection_skips_global_options():
    assert cli._command_of(["--log-level", "INFO", "executor", "--port", "1"]) == "executor"
    assert cli._command_of(["generate", "x"]) == "generate"
    assert cli._command_of(["--help"]) is None


def test_service_verbs_are_listed_without_importing_them(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for verb in ("generate", "up", "executor", "scheduler"):
        assert verb in out


def test_up_command_lines(monkeypatch):
    monkeypatch.delenv("TANDEM_MODEL", raising=False)
    args = parse(
        "up", "--port", "7001", "--executor-port", "7002", "--metrics-port", "0", "--max-num-seqs", "8"
    )
    executor, scheduler = up.service_argv(args)
    assert args.model == str(DEFAULT_MODEL) and (DEFAULT_MODEL / "config.json").is_file()
    assert executor[executor.index("--model") + 1] == str(DEFAULT_MODEL)
    assert executor[1:3] == ["-m", "executor_service"]
    assert executor[executor.index("--port") + 1] == "7002"
    assert executor[executor.index("--max-num-seqs") + 1] == "8"
    assert scheduler[1:3] == ["-m", "scheduler_service"]
    assert scheduler[scheduler.index("--executor") + 1] == "127.0.0.1:7002"
    assert scheduler[scheduler.index("--port") + 1] == "7001"
    assert scheduler[scheduler.index("--metrics-port") + 1] == "0"


def test_up_refuses_a_directory_without_a_checkpoint(tmp_path, capsys):
    assert cli.main(["up", "--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
        (
            ["--startup-timeout", "0"],
            "--startup-timeout must be a positive, finite number of seconds, got 0.0",
        ),
        (
            ["--startup-timeout", "nan"],
            "--startup-timeout must be a positive, finite number of seconds, got nan",
        ),
        (
            ["--shutdown-timeout", "nan"],
            "--shutdown-timeout must be a finite number of seconds >= 0, got nan",
        ),
        (["--grace", "-1"], "--grace must be a finite number of seconds >= 0, got -1.0"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--port", "99999"], "--port must be in [1, 65535], got 99999"),
        (["--port", "0"], "--port must be in [1, 65535], got 0"),
        (["--executor-port", "-1"], "--executor-port must be in [1, 65535], got -1"),
        (["--http-port", "65536"], "--http-port must be in [0, 65535] (0: none), got 65536"),
        (
            ["--executor-metrics-port", "-1"],
            "--executor-metrics-port must be in [0, 65535] (0: none), got -1",
        ),
        # A traceback of the client's int32 check once both services had started.
        (["--max-tokens", "1000000000000"], "--max-tokens must be at most 2147483647, got 1000000000000"),
        # The scheduler failed to bind its port once the executor had loaded the model.
        (
            ["--port", "7100", "--executor-port", "7100"],
            "--executor-port and --port are both 7100: each needs a port of its own",
        ),
        (
            ["--http-port", "7101", "--executor-metrics-port", "7101"],
            "--executor-metrics-port and --http-port are both 7101: each needs a port of its own",
        ),
    ],
)
def test_up_refuses_bad_values_before_starting_anything(tmp_path, capsys, flags, message):
    """--max-num-seqs 0 was dropped (both services ran with 256); a NaN startup timeout or grace
    never ran out (a service that hung was waited for for ever); a scheduler port out of range
    failed the scheduler once the executor had loaded the model."""
    assert cli.main(["up", "--model", str(tmp_path), *flags]) == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_up_refuses_a_log_dir_it_cannot_make(tmp_path, capsys):
    """A --log-dir that is a file was a FileExistsError traceback."""
    (tmp_path / "file").write_text("")
    assert (
        cli.main(["up", "--log-dir", str(tmp_path / "file"), "--port", "7102", "--executor-port", "7103"])
        == 2
    )
    err = capsys.readouterr().err
    assert f"error: --log-dir {tmp_path / 'file'}: File exists" in err and "Traceback" not in err


def test_generate_server_path_needs_no_torch():
    script = f"""
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy", "executor_service"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Blocker())
from client.cli import main
rc = main(["generate", "--server", "127.0.0.1:{free_port()}", "hello", "--timeout", "5"])
assert "torch" not in sys.modules
print("rc", rc)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.split() == ["rc", "1"], proc.stderr
    assert "no tandem server" in proc.stderr


# --- the clients against a fake GenerationService --------------------------------------------


class FakeGeneration(pb_grpc.GenerationServiceServicer):
    """Tokens 1..max_tokens, text "t1 t2 ...", two tokens per chunk. max_tokens 0 streams until
    cancelled; temperature 99 is rejected."""

    def __init__(self):
        self.cancelled = threading.Event()
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict] = []

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        sp = request.sampling_params
        if sp.temperature == 99:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature 99 is too hot")
        if request.WhichOneof("prompt") == "chat" and request.chat.messages[-1].content == "TOO LONG":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is longer than max_model_len")
        n_prompt = len(request.token_ids.ids) if request.WhichOneof("prompt") == "token_ids" else 3
        if sp.max_tokens == 0:
            context.add_callback(self.cancelled.set)
            i = 0
            while context.is_active():
                i += 1
                yield pb.GenerateResponse(chunk=pb.GenerateChunk(token_ids=[i], text=f"t{i} "))
                time.sleep(0.005)
            return
        tokens = list(range(1, sp.max_tokens + 1))
        for start in range(0, len(tokens), 2):
            ids = tokens[start : start + 2]
            chunk = pb.GenerateChunk(token_ids=ids, text="".join(f"t{t} " for t in ids))
            if sp.logprobs:
                for t in ids:
                    chunk.logprobs.add(
                        token_id=t, logprob=-0.5, top_logprobs=[pb.Logprob(token_id=t, logprob=-0.5)]
                    )
            yield pb.GenerateResponse(request_id=request.request_id, chunk=chunk)
        yield pb.GenerateResponse(
            request_id=request.request_id,
            final=pb.GenerateFinal(
                finish_reason=pb.FINISH_REASON_LENGTH,
                prompt_tokens=n_prompt,
                completion_tokens=len(tokens),
                cached_tokens=1,
            ),
        )

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(model="fake", max_model_len=128, vocab_size=512, eos_token_ids=[0])


@pytest.fixture(scope="module")
def fake_server():
    server = grpc.server(futures.ThreadPoolExecutor(8))
    servicer = FakeGeneration()
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_sync_stream_chunks_then_final(fake_server):
    address, servicer = fake_server
    with TandemClient(address, api_key="secret") as client:
        items = list(client.generate([4, 5, 6, 7], request_id="abc", max_tokens=5))
    assert [type(i) for i in items] == [Chunk, Chunk, Chunk, Final]
    assert [i.token_ids for i in items[:3]] == [[1, 2], [3, 4], [5]]
    final = items[-1]
    assert (final.finish_reason, final.prompt_tokens, final.completion_tokens) == ("length", 4, 5)
    assert final.cached_tokens == 1 and final.stop_reason is None and final.request_id == "abc"
    assert servicer.metadata[-1]["authorization"] == "Bearer secret"


def test_sync_complete_logprobs_model_info_health(fake_server):
    address, _ = fake_server
    with TandemClient(address, timeout=10) as client:
        done = client.complete("hi", max_tokens=3, logprobs=1)
        assert done.text == "t1 t2 t3 " and done.token_ids == [1, 2, 3] and done.finish_reason == "length"
        assert [lp.token_id for lp in done.logprobs] == [1, 2, 3]
        assert done.logprobs[0].top_logprobs == [(1, -0.5)]
        info = client.model_info()
        assert (info.model, info.max_model_len, info.eos_token_ids) == ("fake", 128, [0])
        assert client.health() == "SERVING"


def test_errors_carry_the_status_code(fake_server):
    address, _ = fake_server
    with TandemClient(address) as client, pytest.raises(TandemError) as err:
        client.complete("hi", temperature=99)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "too hot" in err.value.message
    with TandemClient(f"127.0.0.1:{free_port()}") as client, pytest.raises(TandemError) as err:
        client.model_info()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_cancel_aborts_on_the_server(fake_server):
    address, servicer = fake_server
    servicer.cancelled.clear()
    with TandemClient(address) as client:
        stream = client.generate("forever", max_tokens=0)
        received = [next(stream) for _ in range(3)]
        stream.cancel()
        assert list(stream) == []  # ends quietly, no error
        assert [c.token_ids for c in received] == [[1], [2], [3]]
    assert servicer.cancelled.wait(5)


def test_breaking_out_of_a_stream_cancels_it_on_the_server(fake_server):
    """A caller that stops iterating (break) without a `with` block or cancel() frees the request on
    the server as soon as it lets go of the stream, not at some later garbage collection (disabled
    here, so that the test does not pass by luck)."""
    address, servicer = fake_server
    servicer.cancelled.clear()
    gc.disable()
    try:
        with TandemClient(address) as client:
            for item in client.generate("forever", max_tokens=0):
                if item.token_ids == [3]:
                    break
            assert servicer.cancelled.wait(5), "the server still generates for an abandoned stream"
    finally:
        gc.enable()


def test_breaking_out_of_an_async_stream_cancels_it_on_the_server(fake_server):
    address, servicer = fake_server
    servicer.cancelled.clear()

    async def main():
        async with AsyncTandemClient(address) as client:
            async for item in client.generate("forever", max_tokens=0):
                if item.token_ids == [3]:
                    break
            for _ in range(100):
                if servicer.cancelled.is_set():
                    return True
                await asyncio.sleep(0.05)
            return False

    gc.disable()
    try:
        assert asyncio.run(main()), "the server still generates for an abandoned stream"
    finally:
        gc.enable()


def test_async_client(fake_server):
    address, servicer = fake_server

    async def main():
        async with AsyncTandemClient(address) as client:
            results = await asyncio.gather(*(client.complete([1] * n, max_tokens=n) for n in (1, 2, 3, 4)))
            assert [r.token_ids for r in results] == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]
            assert [r.prompt_tokens for r in results] == [1, 2, 3, 4]
            assert (await client.model_info()).vocab_size == 512
            assert await client.health() == "SERVING"
            with pytest.raises(TandemError) as err:
                await client.complete("x", temperature=99)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            servicer.cancelled.clear()
            stream = client.generate("forever", max_tokens=0)
            async for item in stream:
                if item.token_ids == [3]:
                    stream.cancel()
            assert stream.final is None

    asyncio.run(main())
    assert servicer.cancelled.wait(5)


def test_closing_the_async_client_ends_its_open_streams_with_tandem_error(fake_server):
    """A stream read while its client closes ends in TandemError(CANCELLED), as the sync client's
    does, and the server stops generating; not in a CancelledError, which would look like the
    reading task's own cancellation (gather, TaskGroup and the task's cancelled() believe it)."""
    address, servicer = fake_server
    servicer.cancelled.clear()

    async def main():
        client = AsyncTandemClient(address)
        stream = client.generate("forever", max_tokens=0)

        async def read():
            async for _ in stream:
                pass

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.3)  # the reader is reading
        await client.close()
        with pytest.raises(TandemError) as err:
            await reader
        assert err.value.code == grpc.StatusCode.CANCELLED and not reader.cancelled()
        with TandemClient(address) as sync_client:
            sync_stream = sync_client.generate("forever", max_tokens=0)
            next(sync_stream)
        with pytest.raises(TandemError) as err:
            list(sync_stream)
        assert err.value.code == grpc.StatusCode.CANCELLED

    asyncio.run(main())
    assert servicer.cancelled.wait(5)


def test_cli_generate_against_a_server(fake_server, capsys):
    address, _ = fake_server
    assert cli.main(["generate", "--server", address, "one", "two", "--max-tokens", "3", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "cached_tokens": 1}
    line = {"token_ids": [1, 2, 3], "text": "t1 t2 t3 ", "finish_reason": "length", "usage": usage}
    assert lines == [line] * 2
    assert cli.main(["generate", "--server", address, "one", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out == "t1 t2 t3 t4 t5 \n"
    assert cli.main(["generate", "--server", address, "x", "--temperature", "99"]) == 2
    assert "INVALID_ARGUMENT: temperature 99 is too hot" in capsys.readouterr().err


def test_ctrl_c_at_the_chat_prompt_ends_the_conversation_with_130():
    """Ctrl-C while `tandem chat` waits for a line exits 130, as during a reply, with no traceback."""
    import io

    from client.chat import run_chat
    from client.cli import build_parser

    class Interrupted(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

        def isatty(self) -> bool:
            return True

    args = build_parser(["chat"]).parse_args(["chat", "--server", "127.0.0.1:1"])
    out = io.StringIO()
    try:
        code = run_chat(args, stdin=Interrupted(), out=out)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C at the prompt escaped run_chat (a traceback for the user)")
    assert code == 130
    assert out.getvalue() == "> \n"


def test_generate_in_process_refuses_a_missing_tokenizer_before_loading_the_model(
    tmp_path, monkeypatch, capsys
):
    """--tokenizer naming nothing was found only once the model had loaded (and its executor was
    left running in the library)."""
    import executor_service.executor

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(executor_service.executor, "LocalExecutor", load)
    argv = ["generate", "--model", str(DEFAULT_MODEL), "--tokenizer", str(tmp_path / "none"), "x"]
    assert cli.main(argv) == 2
    assert f"error: no tokenizer.json in {tmp_path / 'none'}" in capsys.readouterr().err


def test_chat_at_a_terminal_goes_on_after_a_refused_message(fake_server, capsys):
    """At a terminal, a message the server refuses (INVALID_ARGUMENT: too long) is reported and left
    out, and the conversation goes on (it ended the whole session); Ctrl-D then ends it on a line of
    its own. Piped, the refusal still ends the command with its code, as a script expects."""
    import io

    from client.chat import run_chat
    from client.cli import build_parser

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    address, servicer = fake_server
    argv = ["chat", "--server", address, "--max-tokens", "2"]
    args = build_parser(argv).parse_args(argv)
    out = io.StringIO()
    assert run_chat(args, stdin=Terminal("hello\nTOO LONG\nagain\n"), out=out) == 0
    assert "INVALID_ARGUMENT: the prompt is longer than max_model_len" in capsys.readouterr().err
    last = servicer.requests[-1].chat.messages
    assert [(m.role, m.content) for m in last] == [
        ("user", "hello"),
        ("assistant", "t1 t2 "),
        ("user", "again"),
    ]
    assert out.getvalue().endswith("> \n")
    assert run_chat(args, stdin=io.StringIO("hello\nTOO LONG\nagain\n"), out=io.StringIO()) == 2


def test_json_output_writes_a_ruled_out_token_s_logprob_as_json_can_carry_it():
    """`tandem generate --json`: a logprob of -inf (a token the model rules out, e.g. by logit_bias)
    is written -9999.0, as the HTTP API writes it, not -Infinity, which no JSON parser reads."""
    from client.messages import TokenLogprob, logprobs_json

    line = logprobs_json([TokenLogprob(5, float("-inf"), [(5, float("-inf")), (7, -0.5)], "a", ["a", "b"])])
    text = json.dumps(line, allow_nan=False)  # raises on an infinity
    assert json.loads(text)[0]["logprob"] == -9999.0
    assert [t["logprob"] for t in json.loads(text)[0]["top_logprobs"]] == [-9999.0, -0.5]
