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
