"""`--model ORG/NAME` from the local Hugging Face cache (protos/hub.py): resolved by
revision, never downloaded, and a one-line error naming where it looked when the snapshot is absent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from protos.hub import resolve_model

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, qwen3_tied, monkeypatch):
    """A cache holding tiny/qwen3 at one commit, reached by `main` and by the tag `v1`."""
    repo = tmp_path / "hub" / "models--tiny--qwen3"
    shutil.copytree(qwen3_tied, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    for ref in ("main", "v1"):
        (repo / "refs" / ref).write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return repo


def test_hub_id_resolves_to_the_cached_snapshot(hub_cache, monkeypatch, tmp_path):
    snapshot = str(hub_cache / "snapshots" / COMMIT)
    assert resolve_model("tiny/qwen3") == snapshot
    assert resolve_model("tiny/qwen3", "v1") == snapshot
    assert resolve_model("tiny/qwen3", COMMIT) == snapshot
    # HF_HOME/hub when HF_HUB_CACHE is unset.
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model("tiny/qwen3") == snapshot
    # A directory is itself, whatever its name looks like.
    assert resolve_model(str(hub_cache)) == str(hub_cache)


@pytest.mark.parametrize(("model", "revision"), [("tiny/absent", None), ("tiny/qwen3", "v2")])
def test_missing_snapshot_names_where_it_looked(hub_cache, model, revision):
    with pytest.raises(
        FileNotFoundError, match=r"not in the Hugging Face cache: looked for .*models--tiny--"
    ):
        resolve_model(model, revision)


def test_cli_generate_from_the_cache(hub_cache, qwen3_tied):
    from helpers.hf_reference import hf_greedy

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "client.cli", "generate", "--model", "tiny/qwen3", "--json"]
    args += ["--prompt-ids", "5,6,7,8", "--max-tokens", "8"]
    proc = subprocess.run(args + ["--revision", "v1"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == hf_greedy(qwen3_tied, [5, 6, 7, 8], 8)[0]
    proc = subprocess.run(args + ["--revision", "v9"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "looked for" in lines[0] and "models--tiny--qwen3" in lines[0], proc.stderr


def test_the_scheduler_and_tandem_up_resolve_hub_ids(hub_cache, monkeypatch, capsys):
    """`--tokenizer ORG/NAME` on the scheduler (the same cache as the executor's --model), and
    `tandem up --model ORG/NAME` hands the executor the id (which it resolves, and serves under
    that name) and the scheduler the snapshot as its tokenizer."""
    import argparse

    from client import up
    from scheduler_service.tokenizer import Tokenizer

    snapshot = hub_cache / "snapshots" / COMMIT
    assert Tokenizer(resolve_model("tiny/qwen3")).encode("def f") == Tokenizer(snapshot).encode("def f")

    class Started(Exception):
        pass

    def service_argv(args):
        raise Started(args)

    monkeypatch.setattr(up, "service_argv", service_argv)
    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    with pytest.raises(Started) as started:
        up.run_up(parser.parse_args(["up", "--model", "tiny/qwen3"]))
    assert started.value.args[0].model == "tiny/qwen3"
    assert started.value.args[0].tokenizer == str(snapshot)
    assert up.run_up(parser.parse_args(["up", "--model", "tiny/absent"])) == 2
    assert "not in the Hugging Face cache" in capsys.readouterr().err
