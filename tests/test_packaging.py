"""A wheel (`pip install .`, not editable) carries everything the default commands need: the
embedded model included, found outside any source tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from a copy of the tracked files, installed into a folder of its own."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to know the tracked files")
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(
        b"\0"
    )
    for name in filter(None, files):
        path = ROOT / name.decode()
        if path.is_file():
            (src / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name.decode())
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (base / "dist").glob("tandem-*.whl")
    target = base / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, capture_output=True
    )
    return target


def _run(installed: Path, *args: str) -> subprocess.CompletedProcess:
    # The installed copy first on the path, and a working directory outside the source tree.
    env = {**os.environ, "PYTHONPATH": str(installed)}
    env.pop("TANDEM_MODEL", None)
    return subprocess.run(
        [sys.executable, *args], cwd=installed.parent, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_wheel_carries_the_embedded_model_and_the_default_command_runs(installed):
    found = _run(
        installed,
        "-c",
        "import client.defaults as d, executor_service.cli as e, argparse\n"
        "p = argparse.ArgumentParser(); e.add_arguments(p)\n"
        "print(d.__file__); print(p.parse_args([]).model)",
    )
    assert found.returncode == 0, found.stderr
    module, model = found.stdout.split()
    assert Path(module).is_relative_to(installed), "imported the source tree, not the wheel"
    assert Path(model).is_relative_to(installed)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (Path(model) / name).is_file(), f"the wheel lacks the embedded model's {name}"
    generated = _run(
        installed,
        "-m",
        "client.cli",
        "generate",
        "--model",
        model,
        "--max-tokens",
        "4",
        "--json",
        "The list type",
    )
    assert generated.returncode == 0, generated.stderr
    out = json.loads(generated.stdout.splitlines()[-1])
    assert len(out["token_ids"]) == 4 and out["text"]
