"""Only the right callers get in: API keys and TLS on the scheduler's client port, mutual TLS from
the scheduler's RemoteExecutor to an executor (the real ExecutorService servicer behind a TLS
server built here), default bind addresses. Certificates are made here with `cryptography`."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from helpers.tls import CA

from client import TandemClient, TandemError
from client.defaults import REPO_ROOT
from executor_service.config import ExecutorConfig
from executor_service.executor import LocalExecutor
from executor_service.metrics import ExecutorMetrics
from executor_service.server import ExecutorServicer
from protos.tandem.v1 import executor_pb2_grpc as epb_grpc
from scheduler_service.async_engine import EngineOptions
from scheduler_service.config import SchedulerConfig
from scheduler_service.executor_client import ExecutorError, RemoteExecutor
from scheduler_service.security import load_api_keys, server_credentials
from scheduler_service.server import SchedulerServer, ServerThread
from scheduler_service.tokenizer import Tokenizer

KEY = "s3cret-key-0123456789"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def pki():
    ca, other = CA("tandem test CA"), CA("another CA")
    return {
        "ca": ca.pem,
        "other_ca": other.pem,
        "server": ca.issue("localhost", server=True),
        "client": ca.issue("scheduler", server=False),
        "other_server": other.issue("localhost", server=True),
        "other_client": other.issue("scheduler", server=False),
    }


def _scheduler(model, executor=None, **kwargs) -> SchedulerServer:
    executor = executor or LocalExecutor(ExecutorConfig(model=str(model), num_kv_blocks=64))
    tokenizer = Tokenizer(model)
    return SchedulerServer(
        executor,
        EngineOptions(SchedulerConfig(max_num_seqs=8), heartbeat_s=0.2, backoff_max_s=0.2),
        tokenizer_for=lambda info: tokenizer,
        port=0,
        **kwargs,
    )


@pytest.fixture(scope="module")
def secured(qwen3_tied, pki, tmp_path_factory):
    """A scheduler with TLS and two API keys (one given, one from a file)."""
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text("# rotated keys\nold-key-abc\n\n")
    cert, key = pki["server"]
    server = _scheduler(
        qwen3_tied, api_keys=load_api_keys(KEY, key_file), tls_credentials=server_credentials(cert, key)
    )
    with ServerThread(server):
        address = f"127.0.0.1:{server.port}"
        with TandemClient(address, tls_ca=pki["ca"]) as client:
            client.wait_until_serving(30)  # health needs no key
        yield address


def _complete(address: str, **kwargs):
    with TandemClient(address, timeout=10, **kwargs) as client:
        return client.complete([5, 6, 7], max_tokens=3, ignore_eos=True)


def test_the_right_caller_gets_in(secured, pki):
    assert len(_complete(secured, tls_ca=pki["ca"], api_key=KEY).token_ids) == 3
    # A key from the key file; the scheme name is case-insensitive.
    assert len(_complete(secured, tls_ca=pki["ca"], api_key="old-key-abc").token_ids) == 3
    with TandemClient(secured, tls_ca=pki["ca"], timeout=10) as client:
        client._metadata = [("authorization", f"bearer {KEY}")]
        assert client.model_info().vocab_size == 512


@pytest.mark.parametrize("key", [None, "wrong", KEY + "x", KEY[:-1], "", "old-key-ab", "OLD-KEY-ABC"])
def test_without_the_right_key_unauthenticated(secured, pki, key):
    with pytest.raises(TandemError) as err:
        _complete(secured, tls_ca=pki["ca"], api_key=key)
    assert err.value.code == UNAUTHENTICATED and "API key" in err.value.message
    with TandemClient(secured, tls_ca=pki["ca"], api_key=key, timeout=10) as client:
        with pytest.raises(TandemError) as err:
            client.model_info()
        assert err.value.code == UNAUTHENTICATED
        assert client.health() == "SERVING"  # health checks stay open


def test_a_key_in_another_header_or_scheme_is_refused(secured, pki):
    for metadata in ([("x-api-key", KEY)], [("authorization", KEY)], [("authorization", f"Basic {KEY}")]):
        with TandemClient(secured, tls_ca=pki["ca"], timeout=10) as client:
            client._metadata = metadata
            with pytest.raises(TandemError) as err:
                client.complete([5], max_tokens=1)
        assert err.value.code == UNAUTHENTICATED, metadata


def test_plaintext_or_an_untrusted_certificate_does_not_connect(secured, pki):
    for kwargs in ({}, {"tls_ca": pki["other_ca"]}, {"tls": True}):  # system CAs do not know ours
        with pytest.raises(TandemError) as err:
            _complete(secured, api_key=KEY, **kwargs)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, kwargs


def test_the_cli_names_a_tls_mismatch_rather_than_a_missing_server(secured, pki, tmp_path, capsys):
    """`tandem generate` against a server that is there but whose TLS does not match said "no
    tandem server at ...; start one with `tandem up`" (whose port is then in use): it names TLS."""
    from client import cli

    (tmp_path / "other.pem").write_bytes(pki["other_ca"])
    base = ["generate", "x", "--max-tokens", "1", "--server", secured, "--retries", "0", "--api-key", KEY]
    for flags, hint in (
        ([], "connect with --tls-ca"),
        (["--tls-ca", str(tmp_path / "other.pem")], "--tls-ca must be"),
    ):
        assert cli.main([*base, *flags]) == 1
        err = capsys.readouterr().err
        assert "no tandem server" not in err and "tandem up" not in err, flags
        assert "TLS" in err and hint in err, err


def test_a_server_certificate_from_another_ca_is_refused_by_the_client(qwen3_tied, pki):
    cert, key = pki["other_server"]
    server = _scheduler(qwen3_tied, tls_credentials=server_credentials(cert, key))
    with ServerThread(server):
        address = f"127.0.0.1:{server.port}"
        with pytest.raises(TandemError) as err:
            _complete(address, tls_ca=pki["ca"])
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert len(_complete(address, tls_ca=pki["other_ca"]).token_ids) == 3


def test_every_key_is_compared_with_compare_digest(monkeypatch):
    """The key check runs in constant time: hmac.compare_digest against every configured key,
    whether the caller's key is right, wrong, of another length or missing (no early exit)."""
    import asyncio
    import hmac
    from types import SimpleNamespace

    from protos import api_keys
    from scheduler_service import security

    keys = ["k-short", KEY, "a-rather-longer-key-than-the-others-0123456789"]
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", spy)
    interceptor = security.ApiKeyInterceptor(keys)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details):
        return handler

    def admitted(metadata) -> bool:
        details = SimpleNamespace(
            method="/tandem.v1.GenerationService/GetModelInfo", invocation_metadata=metadata
        )
        return asyncio.run(interceptor.intercept_service(continuation, details)) is handler

    for token, right in (
        (KEY, True),  # the second key: the third is still compared
        ("k-short", True),
        ("x" * len(KEY), False),  # wrong, same length as a key
        ("wrong", False),  # wrong, another length than every key
        (KEY + "-and-more", False),
        (None, False),  # no header: compared as an empty token
    ):
        compared.clear()
        metadata = () if token is None else (("authorization", f"Bearer {token}"),)
        assert admitted(metadata) is right, token
        want = b"" if token is None else token.encode()
        assert compared == [(want, key.encode()) for key in keys], token


# -- mutual TLS from the scheduler to the executor ----------------------------------------------


@pytest.fixture(scope="module")
def mtls_executor(qwen3_tied, pki):
    """The executor's own servicer behind a gRPC server, built here, that requires client
    certificates of our CA: the RemoteExecutor side in-process. The executor service's own flags
    (`--tls-cert/--tls-key/--tls-ca`) are tested as a process in test_executor_security.py."""
    servicer = ExecutorServicer(ExecutorMetrics())
    servicer.executor = LocalExecutor(ExecutorConfig(model=str(qwen3_tied), num_kv_blocks=64))
    server = grpc.server(ThreadPoolExecutor(8))
    epb_grpc.add_ExecutorServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # "" is SERVING
    cert, key = pki["server"]
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=pki["ca"], require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_mutual_tls_to_the_executor(mtls_executor, pki, qwen3_tied):
    cert, key = pki["client"]
    with RemoteExecutor(mtls_executor, tls_ca=pki["ca"], tls_cert=cert, tls_key=key, connect_timeout=5) as ex:
        assert ex.describe().vocab_size == 512
    # The whole scheduler over it.
    executor = RemoteExecutor(mtls_executor, tls_ca=pki["ca"], tls_cert=cert, tls_key=key, connect_timeout=5)
    server = _scheduler(qwen3_tied, executor)
    with ServerThread(server):
        address = f"127.0.0.1:{server.port}"
        with TandemClient(address) as client:
            client.wait_until_serving(30)
        assert len(_complete(address).token_ids) == 3
    executor.close()


@pytest.mark.parametrize(
    "who", ["plaintext", "no-client-cert", "client-cert-of-another-ca", "trusts-another-ca"]
)
def test_the_executor_refuses_or_is_refused(mtls_executor, pki, who):
    cert, key = pki["client"]
    other_cert, other_key = pki["other_client"]
    kwargs = {
        "plaintext": {},
        "no-client-cert": {"tls_ca": pki["ca"]},
        "client-cert-of-another-ca": {"tls_ca": pki["ca"], "tls_cert": other_cert, "tls_key": other_key},
        "trusts-another-ca": {"tls_ca": pki["other_ca"], "tls_cert": cert, "tls_key": key},
    }[who]
    with RemoteExecutor(mtls_executor, connect_timeout=3, **kwargs) as ex, pytest.raises(ExecutorError):
        ex.describe()


def test_remote_executor_tls_arguments_are_checked(pki, tmp_path):
    cert, key = pki["client"]
    with pytest.raises(ValueError, match="go together"):
        RemoteExecutor("127.0.0.1:1", tls_ca=pki["ca"], tls_cert=cert)
    with pytest.raises(ValueError, match="needs its CA"):
        RemoteExecutor("127.0.0.1:1", tls_cert=cert, tls_key=key)
    with pytest.raises(ValueError, match="cannot read"):
        RemoteExecutor("127.0.0.1:1", tls_ca=tmp_path / "missing.pem")


# -- flags and defaults ----------------------------------------------------------------------------


def test_services_bind_loopback_by_default():
    import argparse
    import inspect

    from executor_service import server as executor_server
    from scheduler_service import cli

    assert inspect.signature(SchedulerServer).parameters["host"].default == "127.0.0.1"
    assert executor_server.DEFAULT_HOST == "127.0.0.1"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--executor", "127.0.0.1:1"])
    assert args.host == "127.0.0.1"
    assert (args.api_key, args.tls_cert, args.executor_tls_ca, args.shutdown_timeout) == (
        None,
        None,
        None,
        30.0,
    )


def test_scheduler_cli_refuses_half_a_tls_config_and_a_missing_key_file(tmp_path, monkeypatch, capsys):
    import argparse

    from scheduler_service import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    base = ["--executor", "127.0.0.1:1", "--metrics-port", "0"]
    assert cli.run(parser.parse_args([*base, "--tls-cert", str(tmp_path / "c.pem")])) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert cli.run(parser.parse_args([*base, "--api-key-file", str(tmp_path / "none")])) == 2
    assert "cannot read the API key file" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    assert cli.run(parser.parse_args([*base, "--api-key-file", str(empty)])) == 2
    assert "holds no key" in capsys.readouterr().err
    monkeypatch.setenv("TANDEM_API_KEY_FILE", str(empty))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args(base).api_key_file == str(empty)


def test_tls_files_that_are_no_pem_are_refused_naming_their_flags(pki, tmp_path, capsys):
    """A certificate or key that is no PEM, or a key of another certificate, failed the start as
    "cannot listen on 127.0.0.1:50051: Failed to bind to address" (a port problem, said gRPC); a CA
    that is no PEM was taken, and every connection to the executor then failed its handshake (the
    client's: "no tandem server at ...")."""
    import argparse

    from executor_service import cli as executor_cli
    from scheduler_service import cli as scheduler_cli

    def write(name: str, data: bytes) -> str:
        (tmp_path / name).write_bytes(data)
        return str(tmp_path / name)

    cert, key = write("cert.pem", pki["server"][0]), write("key.pem", pki["server"][1])
    other_key, junk = (
        write("other-key.pem", pki["other_server"][1]),
        write("junk.pem", b"not a certificate\n"),
    )
    ca = write("ca.pem", pki["ca"])
    pair = "are not a PEM certificate chain and its private key"
    cases = [
        (scheduler_cli, ["--tls-cert", junk, "--tls-key", key], f"--tls-cert and --tls-key {pair} (not PEM)"),
        (
            scheduler_cli,
            ["--tls-cert", cert, "--tls-key", other_key],
            f"--tls-cert and --tls-key {pair} (the key",
        ),
        (scheduler_cli, ["--executor-tls-ca", junk], f"--executor-tls-ca {junk} holds no PEM CA certificate"),
        (
            scheduler_cli,
            ["--executor-tls-ca", ca, "--executor-tls-cert", cert, "--executor-tls-key", junk],
            f"--executor-tls-cert and --executor-tls-key {pair}",
        ),
        (executor_cli, ["--tls-cert", junk, "--tls-key", key], f"--tls-cert and --tls-key {pair}"),
        (
            executor_cli,
            ["--tls-cert", cert, "--tls-key", key, "--tls-ca", junk],
            f"--tls-ca {junk} holds no PEM",
        ),
    ]
    for cli, flags, message in cases:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        base = ["--executor", "127.0.0.1:1"] if cli is scheduler_cli else []
        args = parser.parse_args([*base, "--port", "0", "--metrics-port", "0", *flags])
        assert cli.run(args) == 2, flags
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds no PEM CA certificate"):
        TandemClient("127.0.0.1:1", tls_ca=junk)


def test_scheduler_help_names_its_side_of_the_executors_tls_ca():
    """The issue's `--tls-ca` "on both sides": on the scheduler it is --executor-tls-ca (with
    --executor-tls-cert/--executor-tls-key), and --help says so."""
    import argparse

    from scheduler_service import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    flags = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    assert {"--executor-tls-ca", "--executor-tls-cert", "--executor-tls-key"} <= flags.keys()
    assert "the scheduler's --tls-ca" in flags["--executor-tls-ca"].help
    assert "executor's --tls-ca" in flags["--executor-tls-cert"].help
    text = " ".join(parser.format_help().split())
    assert (
        "The scheduler's side of mutual TLS with the executor (the executor's --tls-ca) is --executor-tls-ca"
        in text
    )


def _healthcheck(service: str, address: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """deploy/healthcheck.py (the images' probe) with the environment a container would give it."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "deploy" / "healthcheck.py"), service, "--address", address, *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_image_probe_checks_a_tls_scheduler(secured, pki, tmp_path):
    cert, _ = pki["server"]
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "ca.pem").write_bytes(pki["ca"])
    (tmp_path / "other.pem").write_bytes(pki["other_ca"])
    # As before: plaintext against a TLS port fails.
    assert _healthcheck("scheduler", secured, {}).returncode == 1
    # The scheduler's own TLS variable turns TLS on; the CA comes from the probe's variable or flag.
    tls = {"TANDEM_TLS_CERT": str(tmp_path / "cert.pem")}
    ok = _healthcheck("scheduler", secured, {**tls, "TANDEM_HEALTHCHECK_TLS_CA": str(tmp_path / "ca.pem")})
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    assert _healthcheck("scheduler", secured, tls, "--tls-ca", str(tmp_path / "ca.pem")).returncode == 0
    untrusted = _healthcheck("scheduler", secured, tls, "--tls-ca", str(tmp_path / "other.pem"))
    assert untrusted.returncode == 1 and "TLS" in untrusted.stderr


def test_the_image_probe_checks_a_mutual_tls_executor(mtls_executor, pki, tmp_path):
    cert, _ = pki["server"]
    client_cert, client_key = pki["client"]
    for name, pem in (("cert", cert), ("ca", pki["ca"]), ("client", client_cert), ("client-key", client_key)):
        (tmp_path / f"{name}.pem").write_bytes(pem)
    env = {
        "TANDEM_EXECUTOR_SERVER_TLS_CERT": str(tmp_path / "cert.pem"),
        "TANDEM_EXECUTOR_SERVER_TLS_CA": str(tmp_path / "ca.pem"),  # trusted for the server too
    }
    # No client certificate: the executor refuses the handshake.
    assert _healthcheck("executor", mtls_executor, env).returncode == 1
    probe = {
        "TANDEM_HEALTHCHECK_TLS_CERT": str(tmp_path / "client.pem"),
        "TANDEM_HEALTHCHECK_TLS_KEY": str(tmp_path / "client-key.pem"),
    }
    ok = _healthcheck("executor", mtls_executor, {**env, **probe})
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    half = _healthcheck("executor", mtls_executor, env, "--tls-cert", str(tmp_path / "client.pem"))
    assert half.returncode == 1 and "go together" in half.stderr
