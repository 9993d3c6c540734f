"""The executor service behind mutual TLS (`tandem executor --tls-cert --tls-key --tls-ca`, a real
process): the scheduler's RemoteExecutor with a certificate of our CA gets in; a plaintext
client, a TLS client without a certificate, one whose certificate another CA signed, and one
that trusts another CA do not, health included. Message size limits: a plan over the limit is
RESOURCE_EXHAUSTED and the executor serves the next good plan. Last, both services started from
their command lines with every security flag, driven by the client."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
from executor_fixtures import MiniScheduler
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.processes import CHILD_ENV, ROOT, ServiceProcess
from helpers.services import EXECUTOR_OPTIONS, executor_process, scheduler_process
from helpers.tls import CA

from client import TandemClient, TandemError
from client.defaults import DEFAULT_MODEL, free_port
from executor_service import cli
from executor_service.server import MAX_MESSAGE_BYTES
from protos.tandem.v1 import executor_pb2 as pb
from protos.tandem.v1 import executor_pb2_grpc as pb_grpc
from scheduler_service.executor_client import SERVICE_NAME, ExecutorUnavailable, RemoteExecutor

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
STEP_METHOD = "/tandem.v1.ExecutorService/Step"
_NEW_BLOCK_IDS_FIELD = pb.StepPlan.DESCRIPTOR.fields_by_name["new_block_ids"].number


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """PEM files: our CA, the executor's server certificate, the scheduler's client certificate,
    and another CA with a client and a server certificate of its own."""
    ca, other = CA("tandem test CA"), CA("another CA")
    files = {"ca": ca.pem, "other_ca": other.pem}
    for name, (issuer, cn, server) in {
        "server": (ca, "localhost", True),
        "client": (ca, "scheduler", False),
        "other_client": (other, "scheduler", False),
    }.items():
        files[f"{name}_cert"], files[f"{name}_key"] = issuer.issue(cn, server=server)
    root = tmp_path_factory.mktemp("pki")
    for name, pem in files.items():
        (root / f"{name}.pem").write_bytes(pem)
    return {name: root / f"{name}.pem" for name in files}


def start_tls_executor(model: Path, log: Path, pki: dict[str, Path]) -> ServiceProcess:
    """The executor CLI with mutual TLS; the TLS files come through the TANDEM_* twins for the key
    and the CA, flags for the certificate, so both paths are exercised."""
    env = {
        **CHILD_ENV,
        "TANDEM_EXECUTOR_SERVER_TLS_KEY": str(pki["server_key"]),
        "TANDEM_EXECUTOR_SERVER_TLS_CA": str(pki["ca"]),
    }
    tls = ("--tls-cert", str(pki["server_cert"]))
    return executor_process(log, *tls, model=model, env=env, **EXECUTOR_OPTIONS).start()


def scheduler_side(address: str, pki: dict[str, Path], **kwargs) -> RemoteExecutor:
    tls = dict(tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"])
    return RemoteExecutor(address, **{**tls, **kwargs})


@pytest.fixture(scope="module")
def tls_executor(qwen3_tied, pki, tmp_path_factory):
    ep = start_tls_executor(qwen3_tied, tmp_path_factory.mktemp("tls") / "executor.log", pki)
    try:
        with scheduler_side(ep.address, pki) as remote:
            ep.wait_for(lambda: _ready(remote), what="SERVING over mutual TLS", logs=ep.output)
        yield ep
    finally:
        assert ep.stop() == 0, ep.output()


def _ready(remote: RemoteExecutor) -> bool | None:
    try:
        remote.wait_ready(0.5)
        return True
    except ExecutorUnavailable:
        return None


def _channel(address: str, pki: dict[str, Path], who: str) -> grpc.Channel:
    """A raw channel as `who` (the right scheduler or one of the callers that must not get in)."""
    read = lambda name: pki[name].read_bytes()  # noqa: E731
    if who == "plaintext":
        return grpc.insecure_channel(address)
    credentials = {
        "scheduler": dict(
            root_certificates=read("ca"),
            private_key=read("client_key"),
            certificate_chain=read("client_cert"),
        ),
        "no-client-cert": dict(root_certificates=read("ca")),
        "client-cert-of-another-ca": dict(
            root_certificates=read("ca"),
            private_key=read("other_client_key"),
            certificate_chain=read("other_client_cert"),
        ),
        "trusts-another-ca": dict(
            root_certificates=read("other_ca"),
            private_key=read("client_key"),
            certificate_chain=read("client_cert"),
        ),
    }[who]
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(**credentials))


def test_the_scheduler_gets_in_and_steps(tls_executor, pki):
    with scheduler_side(tls_executor.address, pki, connect_timeout=5) as remote:
        remote.reset()
        assert remote.describe().vocab_size == 512
        mini = MiniScheduler(remote)
        mini.add(1, [5, 6, 7, 8, 9])
        plan = mini.plan({1: 5})
        result = remote.step(plan)
        assert result.seq_ids == [1] and len(result.token_ids) == 1
        mini.update(plan, result)
        assert remote.step(mini.plan(mini.decode_all())).seq_ids == [1]
        assert remote.reset() == 1
    with _channel(tls_executor.address, pki, "scheduler") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == SERVING


@pytest.mark.parametrize(
    "who", ["plaintext", "no-client-cert", "client-cert-of-another-ca", "trusts-another-ca"]
)
def test_everyone_else_is_refused_health_included(tls_executor, pki, who):
    with _channel(tls_executor.address, pki, who) as channel:
        calls = {
            "Describe": lambda: pb_grpc.ExecutorServiceStub(channel).Describe(
                pb.DescribeRequest(), timeout=3
            ),
            "Reset": lambda: pb_grpc.ExecutorServiceStub(channel).Reset(pb.ResetRequest(), timeout=3),
            "Step": lambda: list(
                pb_grpc.ExecutorServiceStub(channel).Step(iter([pb.StepPlan(step_id=1)]), timeout=3)
            ),
            "Health": lambda: health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=3
            ),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (who, name, e.value.details())
    # ... and the RemoteExecutor as that caller fails the same way.
    kwargs = {
        "plaintext": dict(tls_ca=None, tls_cert=None, tls_key=None),
        "no-client-cert": dict(tls_cert=None, tls_key=None),
        "client-cert-of-another-ca": dict(tls_cert=pki["other_client_cert"], tls_key=pki["other_client_key"]),
        "trusts-another-ca": dict(tls_ca=pki["other_ca"]),
    }[who]
    remote = scheduler_side(tls_executor.address, pki, connect_timeout=3, **kwargs)
    with remote, pytest.raises(ExecutorUnavailable, match=tls_executor.address):
        remote.describe()
    # The refused handshakes did not disturb the executor.
    with scheduler_side(tls_executor.address, pki, connect_timeout=5) as remote:
        assert remote.describe().num_kv_blocks == EXECUTOR_OPTIONS["num_kv_blocks"]


# -- message size limits ----------------------------------------------------------------------------


def _oversized_plan(num_bytes: int) -> bytes:
    """A well-formed StepPlan of about `num_bytes`: step_id 1 and a packed new_block_ids column of
    7s (one byte each), built as bytes (a list of 64 million ints would take seconds)."""

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    step_id = bytes([1 << 3 | 0, 1])  # field 1, varint 1
    return step_id + bytes([_NEW_BLOCK_IDS_FIELD << 3 | 2]) + varint(num_bytes) + b"\x07" * num_bytes


def test_oversized_plan_resource_exhausted_then_serves(tls_executor, pki):
    assert pb.StepPlan.FromString(_oversized_plan(5)).new_block_ids == [7] * 5
    with _channel(tls_executor.address, pki, "scheduler") as channel:
        # No serializer: the bytes go out as they are (the client's own send limit is unlimited).
        step = channel.stream_stream(STEP_METHOD, response_deserializer=pb.StepResult.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(step(iter([_oversized_plan(MAX_MESSAGE_BYTES + 1024)]), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert str(MAX_MESSAGE_BYTES) in e.value.details()
    # Over gRPC's default of 4 MiB but under ours the message is read, and its content is refused.
    with _channel(tls_executor.address, pki, "scheduler") as channel:
        step = channel.stream_stream(STEP_METHOD, response_deserializer=pb.StepResult.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(step(iter([_oversized_plan(4 * 2**20 + 1024)]), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "new_block_ids" in e.value.details() and len(e.value.details()) < 1000
    with scheduler_side(tls_executor.address, pki, connect_timeout=5) as remote:
        remote.reset()
        mini = MiniScheduler(remote)
        mini.add(2, [5, 6, 7])
        assert remote.step(mini.plan({2: 3})).seq_ids == [2]
        assert remote.reset() == 1


# -- flags ----------------------------------------------------------------------------------------------


def test_tls_flags_have_env_twins(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["executor"])
    assert (args.tls_cert, args.tls_key, args.tls_ca) == (None, None, None)
    assert cli.tls_credentials(args) is None
    for name in ("CERT", "KEY", "CA"):
        monkeypatch.setenv(f"TANDEM_EXECUTOR_SERVER_TLS_{name}", f"/x/{name.lower()}.pem")
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["executor"])
    assert (args.tls_cert, args.tls_key, args.tls_ca) == ("/x/cert.pem", "/x/key.pem", "/x/ca.pem")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-cert", "{server_cert}"], "--tls-cert and --tls-key go together"),
        (["--tls-key", "{server_key}"], "--tls-cert and --tls-key go together"),
        (["--tls-ca", "{ca}"], "--tls-ca (mutual TLS) needs this executor's own --tls-cert"),
        (
            ["--tls-cert", "{server_cert}", "--tls-key", "/no/such/key.pem"],
            "cannot read the TLS key /no/such",
        ),
        (
            ["--tls-cert", "{server_cert}", "--tls-key", "{server_key}", "--tls-ca", "/no/ca.pem"],
            "cannot read the TLS CA /no/ca.pem",
        ),
    ],
)
def test_cli_refuses_half_a_tls_configuration(pki, capsys, flags, message):
    from client.cli import main

    flags = [f.format(**pki) for f in flags]
    assert main(["executor", "--metrics-port", "0", "--port", str(free_port()), *flags]) == 2
    assert message in capsys.readouterr().err


def test_plaintext_beyond_loopback_is_logged(caplog):
    from executor_service.server import ExecutorServer

    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        caplog.clear()
        server = ExecutorServer(host, 0)
        server.stop(0)
        assert ("without TLS" in caplog.text) == warned, host


# -- both services from the command line, every security flag --------------------------------------

API_KEY = "cli-key-0123456789abcdef"


def _serving(client: TandemClient) -> bool:
    try:
        return client.health(timeout=1.0) == "SERVING"
    except TandemError:
        return False


def test_both_services_from_the_command_line_with_tls_mtls_and_an_api_key(pki, tmp_path):
    """`python -m executor_service --tls-cert --tls-key --tls-ca` and `python -m scheduler_service
    --tls-cert --tls-key --api-key-file --executor-tls-ca --executor-tls-cert --executor-tls-key`
    on the embedded model: a client with the key that trusts the CA gets a generation; without the
    key (or with a wrong one) UNAUTHENTICATED; without the CA it does not connect; a caller of the
    executor without a client certificate is refused. Both exit 0 on SIGTERM."""
    keys = tmp_path / "api-keys"
    keys.write_text(f"# one key a line\n{API_KEY}\n")
    # Only the flags configure the services here, not TANDEM_* variables of the caller.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    executor = executor_process(
        tmp_path / "executor.log",
        *("--num-kv-blocks", "64", "--max-model-len", "256"),
        *("--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])),
        *("--tls-ca", str(pki["ca"])),
        model=DEFAULT_MODEL,
        env=env,
    )
    scheduler = scheduler_process(
        tmp_path / "scheduler.log",
        executor.address,
        "--shutdown-timeout",
        "5",
        *("--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])),
        *("--api-key-file", str(keys)),
        *("--executor-tls-ca", str(pki["ca"])),
        *("--executor-tls-cert", str(pki["client_cert"]), "--executor-tls-key", str(pki["client_key"])),
        env=env,
    )
    address = scheduler.address
    logs = lambda: f"--- executor ---\n{executor.tail()}\n--- scheduler ---\n{scheduler.tail()}"  # noqa: E731
    executor.start()
    scheduler.start()
    try:
        with TandemClient(address, tls_ca=pki["ca"]) as client:
            # Health needs no key; SERVING once the scheduler got through the executor's mTLS.
            deadline = time.monotonic() + 60
            while not _serving(client):
                assert executor.alive() and scheduler.alive(), logs()
                assert time.monotonic() < deadline, logs()
                time.sleep(0.1)
        with TandemClient(address, tls_ca=pki["ca"], api_key=API_KEY, timeout=30) as client:
            out = client.complete("The list type", max_tokens=4, ignore_eos=True)
        assert len(out.token_ids) == 4 and out.finish_reason == "length" and out.text, out
        for key in (None, "wrong-key"):
            client = TandemClient(address, tls_ca=pki["ca"], api_key=key, timeout=10)
            with client, pytest.raises(TandemError) as err:
                client.complete("The list type", max_tokens=4)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED, (key, err.value)
        with TandemClient(address, api_key=API_KEY, timeout=10) as client, pytest.raises(TandemError) as err:
            client.complete("The list type", max_tokens=4)  # plaintext to a TLS port
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        # The executor's --tls-ca: a caller that trusts it but shows no client certificate is refused.
        no_cert = scheduler_side(executor.address, pki, tls_cert=None, tls_key=None, connect_timeout=3)
        with no_cert, pytest.raises(ExecutorUnavailable):
            no_cert.describe()
    finally:
        scheduler.stop(15)
        executor.stop(15)
    assert (scheduler.process.returncode, executor.process.returncode) == (0, 0), logs()
