"""`tandem up` without starting the services: the command lines it builds for the executor and the
scheduler (Service.start is stopped before anything runs), and what the executor would make of them."""

from __future__ import annotations

import argparse
import types

import pytest

from client import cli, up
from client.defaults import DEFAULT_MODEL

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Started(Exception):
    """Raised by the first Service.start: `tandem up` got as far as starting a service."""


@pytest.fixture
def started(monkeypatch, tmp_path):
    """run(*ARGS): `tandem up ARGS` until it would start the scheduler (the executor is taken for
    SERVING without running) -> {service name: its argv}."""

    def run(*argv: str) -> dict[str, list[str]]:
        seen: dict[str, list[str]] = {}

        def start(self):
            seen[self.name] = self.argv
            if self.name == "scheduler":
                raise Started
            self.process = types.SimpleNamespace(pid=0, poll=lambda: 0, returncode=0)

        monkeypatch.setattr(up.Service, "start", start)
        monkeypatch.setattr(up, "_wait_serving", lambda *a: None)
        args = cli.build_parser(["up"]).parse_args(["up", "--log-dir", str(tmp_path / "logs"), *argv])
        with pytest.raises(Started):
            up.run_up(args)
        return seen

    return run


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding tiny/pydoc (the embedded model) at one commit, branch main: as
    huggingface_hub lays it out, the snapshot a directory of links to the files."""
    repo = tmp_path / "hub" / "models--tiny--pydoc"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in DEFAULT_MODEL.iterdir():
        (snapshot / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("TANDEM_REVISION", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    return repo


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _executor_config(argv: list[str]):
    """The ExecutorConfig that `python -m executor_service ARGV` would serve (its own parser)."""
    from executor_service import cli as executor_cli
    from executor_service.config import ExecutorConfig

    assert argv[1:3] == ["-m", "executor_service"]
    parser = argparse.ArgumentParser()
    executor_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["executor", *argv[3:]])
    return ExecutorConfig(model=args.model, revision=args.revision, device=args.device)


def test_up_serves_a_hub_id_under_that_id_not_its_commit_hash(hub_cache, started):
    """`tandem up --model ORG/NAME` served it as the snapshot's commit hash (the executor was given
    the snapshot directory): OpenAI clients sending "model": "ORG/NAME" got 404."""
    executor = started("--model", "tiny/pydoc")["executor"]
    assert _executor_config(executor).model_name == "tiny/pydoc"
    assert COMMIT not in " ".join(executor)


def test_up_resolves_the_revision_the_executor_will(hub_cache, started, monkeypatch):
    """TANDEM_REVISION, which the executor inherits, picks the snapshot up checks too."""
    (hub_cache / "refs" / "main").rename(hub_cache / "refs" / "v1")
    monkeypatch.setenv("TANDEM_REVISION", "v1")
    seen = started("--model", "tiny/pydoc")
    assert _executor_config(seen["executor"]).model_name == "tiny/pydoc"
    assert _value(seen["scheduler"], "--tokenizer") == str(hub_cache / "snapshots" / COMMIT)


def test_up_gives_the_scheduler_the_snapshots_tokenizer(hub_cache, started):
    scheduler = started("--model", "tiny/pydoc")["scheduler"]
    assert _value(scheduler, "--tokenizer") == str(hub_cache / "snapshots" / COMMIT)


def test_up_names_a_directory_as_the_executor_does(started):
    executor = started("--model", str(DEFAULT_MODEL))["executor"]
    assert _value(executor, "--model") == str(DEFAULT_MODEL)
    assert up.served_name(str(DEFAULT_MODEL), str(DEFAULT_MODEL)) == DEFAULT_MODEL.name
    assert _executor_config(executor).model_name == DEFAULT_MODEL.name


def test_up_banner_names_the_served_model(capsys):
    process = types.SimpleNamespace(pid=1)
    service = types.SimpleNamespace(process=process, log_path=DEFAULT_MODEL / "x.log")
    args = cli.build_parser(["up"]).parse_args(["up"])
    up._print_ready(
        args, up.served_name("tiny/pydoc", "/cache/snapshots/" + COMMIT), service, service, "a", "b"
    )
    out = capsys.readouterr().out
    assert "tandem is up (tiny/pydoc on cpu)" in out and COMMIT not in out


# --- the services' environment twins ------------------------------------------------------------

TWINS = {
    "TANDEM_SCHEDULER_PORT": "7101",
    "TANDEM_EXECUTOR_PORT": "7102",
    "TANDEM_SCHEDULER_METRICS_PORT": "0",
    "TANDEM_EXECUTOR_METRICS_PORT": "7104",
    "TANDEM_HTTP_PORT": "7105",
    "TANDEM_SCHEDULER_HOST": "127.0.0.2",
    "TANDEM_EXECUTOR_HOST": "127.0.0.3",
    "TANDEM_SHUTDOWN_TIMEOUT": "12",
    "TANDEM_MAX_NUM_SEQS": "8",
    "TANDEM_DTYPE": "float32",
}


@pytest.fixture
def no_twins(monkeypatch):
    for name in (*TWINS, "TANDEM_SCHEDULER_GRACE", "TANDEM_TOKENIZER", "TANDEM_DEVICE", "TANDEM_MODEL"):
        monkeypatch.delenv(name, raising=False)


def _argv(*argv: str) -> tuple[list[str], list[str]]:
    return up.service_argv(cli.build_parser(["up", *argv]).parse_args(["up", *argv]))


def test_up_passes_the_services_environment_twins_on(no_twins, monkeypatch, tmp_path):
    """TANDEM_SCHEDULER_PORT, TANDEM_SHUTDOWN_TIMEOUT, ... set for the services were overridden by
    the flags `tandem up` always passed them, its own defaults, without a word."""
    for name, value in TWINS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TANDEM_TOKENIZER", str(tmp_path))
    executor, scheduler = _argv()
    assert _value(executor, "--host") == "127.0.0.3" and _value(executor, "--port") == "7102"
    assert _value(executor, "--metrics-port") == "7104" and _value(executor, "--max-num-seqs") == "8"
    assert _value(executor, "--dtype") == "float32"
    assert _value(scheduler, "--executor") == "127.0.0.3:7102"
    assert _value(scheduler, "--host") == "127.0.0.2" and _value(scheduler, "--port") == "7101"
    assert _value(scheduler, "--metrics-port") == "0" and _value(scheduler, "--http-port") == "7105"
    assert _value(scheduler, "--shutdown-timeout") == "12" and _value(scheduler, "--max-num-seqs") == "8"
    assert _value(scheduler, "--tokenizer") == str(tmp_path)
    # The scheduler's older name for its drain time.
    monkeypatch.delenv("TANDEM_SHUTDOWN_TIMEOUT")
    monkeypatch.setenv("TANDEM_SCHEDULER_GRACE", "7")
    assert _value(_argv()[1], "--shutdown-timeout") == "7"


def test_up_waits_on_the_addresses_the_twins_give(no_twins, monkeypatch, started, capsys):
    monkeypatch.setenv("TANDEM_EXECUTOR_PORT", "7102")
    monkeypatch.setenv("TANDEM_SCHEDULER_PORT", "7101")
    started()
    out = capsys.readouterr().out
    assert "starting the executor on 127.0.0.1:7102" in out
    assert "starting the scheduler on 127.0.0.1:7101" in out


def test_up_flags_win_over_the_twins(no_twins, monkeypatch):
    for name, value in TWINS.items():
        monkeypatch.setenv(name, value)
    executor, scheduler = _argv(
        "--host", "0.0.0.0", "--port", "8101", "--executor-port", "8102", "--shutdown-timeout", "3"
    )  # fmt: skip
    assert _value(executor, "--host") == "0.0.0.0" and _value(executor, "--port") == "8102"
    assert _value(scheduler, "--host") == "0.0.0.0" and _value(scheduler, "--port") == "8101"
    assert _value(scheduler, "--executor") == "0.0.0.0:8102"
    assert _value(scheduler, "--shutdown-timeout") == "3"


def test_up_keeps_its_own_defaults_without_twins(no_twins):
    executor, scheduler = _argv()
    assert _value(executor, "--host") == "127.0.0.1" and _value(executor, "--port") == "50052"
    assert _value(executor, "--metrics-port") == "9102" and _value(executor, "--device") == "cpu"
    assert "--max-num-seqs" not in executor and "--dtype" not in executor
    assert _value(scheduler, "--host") == "127.0.0.1" and _value(scheduler, "--port") == "50051"
    assert _value(scheduler, "--metrics-port") == "9101" and _value(scheduler, "--http-port") == "8000"
    assert _value(scheduler, "--shutdown-timeout") == "5"  # not the scheduler's 30: a terminal session
    assert _value(scheduler, "--executor") == "127.0.0.1:50052"


def test_a_bad_twin_is_a_usage_error_naming_it(no_twins, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_SCHEDULER_PORT", "abc")
    with pytest.raises(SystemExit) as e:
        _argv()
    assert e.value.code == 2
    assert "argument --port: invalid int value: 'abc' (from TANDEM_SCHEDULER_PORT)" in capsys.readouterr().err
