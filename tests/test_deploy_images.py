"""deploy/, the images: the Dockerfiles build the images the manifests name, from the right bases, with exec-form entrypoints that run as written; the scheduler image holds no torch, and `tandem scheduler` runs from only the files its Dockerfile copies.

No Docker engine is needed (tests/helpers/deploy.py reads the files); tests/test_deploy_prometheus.py
runs the services and a real Prometheus."""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import subprocess
import sys

import pytest
from helpers.deploy import (
    DEPLOY,
    IMAGE_SCRIPT,
    ROOT,
    THIRD_PARTY_IMAGES,
    VERBS,
    compile_dockerignore,
    copy_instructions,
    dockerfile,
    dockerignore_patterns,
    dockerignored,
    image_files,
    image_name,
    image_of,
    image_top_level_modules,
    k8s_containers,
    k8s_documents,
    load_compose,
    parse_tandem,
    repository_files,
    tandem_command,
)


def test_images_are_the_ones_the_dockerfiles_build():
    ours = {image_of(v) for v in VERBS}
    for name, service in load_compose()["services"].items():
        image = image_name(service["image"])
        if "build" in service:
            dockerfile_path = (
                DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]
            ).resolve()
            assert dockerfile_path.is_file(), name
            assert dockerfile_path.parent == DEPLOY
            assert image == image_of(dockerfile_path.name.removesuffix(".Dockerfile")), name
        else:
            assert service["image"].split(":")[0] in THIRD_PARTY_IMAGES and image not in ours, name
    for c in k8s_containers():
        assert image_name(c.image) in ours, c.where
    for path, doc in k8s_documents():
        if doc["kind"] == "Kustomization":
            assert {i["name"] for i in doc["images"]} == ours, path


def test_dockerfiles_use_exec_form_and_the_right_bases():
    for verb in VERBS:
        docker = dockerfile(verb)
        # exec_form() fails on the shell form (`ENTRYPOINT tandem ...`), where sh gets SIGTERM.
        assert docker.exec_form("ENTRYPOINT") == ["tandem", verb]
    scheduler, executor = dockerfile("scheduler"), dockerfile("executor")
    base = scheduler.values("ARG")
    assert any("python:3" in a and "-slim" in a for a in base)
    installs = " ".join(r for r in scheduler.values("RUN") if "pip install" in r)
    assert (
        "pip install -e ." in installs
        and "[" not in installs
        and "torch" not in installs.split("find_spec")[0]
    )
    assert any("pytorch/pytorch:" in a and "cuda" in a for a in executor.values("ARG"))
    assert 'pip install -e ".[gpu]"' in " ".join(executor.values("RUN"))
    assert any("flash-attn" in r and "||" in r for r in executor.values("RUN")), "flash-attn must be optional"
    assert "/models" in " ".join(executor.values("VOLUME"))


def test_scheduler_image_dependencies_have_no_torch():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert "torch" not in names and not any(n.startswith("nvidia") for n in names)
    copied = " ".join(dockerfile("scheduler").values("COPY"))
    assert "executor_service" not in copied


@pytest.mark.parametrize("verb", VERBS)
def test_entrypoint_runs_as_written(verb):
    """ENTRYPOINT + CMD with the image's ENV, through the same CLI: the flags parse, and `--help`
    (appended last) shows the service's help."""
    docker = dockerfile(verb)
    entrypoint, cmd = docker.exec_form("ENTRYPOINT"), docker.exec_form("CMD")
    assert entrypoint[0] == "tandem"
    args = parse_tandem(entrypoint[1:] + cmd, docker.env)
    assert args.func.__module__ == f"{verb}_service.cli"
    env = {**os.environ, **docker.env}
    out = subprocess.run(
        tandem_command() + entrypoint[1:] + cmd + ["--help"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"usage: tandem {verb}" in out.stdout.replace("\n", " ")


def test_dockerignore_matching():
    patterns = dockerignore_patterns("scheduler")
    assert not dockerignored("scheduler_service/cli.py", patterns)
    assert not dockerignored("models/tandem-tiny-pydoc/tokenizer.json", patterns)
    assert dockerignored("scheduler_service/__pycache__/cli.cpython-312.pyc", patterns)
    assert dockerignored("bench/RESULTS.md", patterns) and dockerignored(".venv/bin/python", patterns)
    assert dockerignored("deploy/scheduler.Dockerfile", patterns)
    assert not dockerignored("deploy/healthcheck.py", patterns)
    later_wins = compile_dockerignore(["# docs only", "*", "!docs", "docs/**/*.tmp", "/docs/keep.tmp"])
    assert not dockerignored("docs/a.md", later_wins) and not dockerignored("docs/sub/b.md", later_wins)
    assert dockerignored("docs/a.tmp", later_wins) and dockerignored("docs/sub/b.tmp", later_wins)
    assert dockerignored("docsx/a.md", later_wins) and dockerignored("docs/keep.tmp", later_wins)


@pytest.mark.parametrize("verb", VERBS)
def test_every_copy_source_survives_the_dockerignore(verb):
    """A COPY of a path the .dockerignore leaves out fails the build ("not found"), and one of a
    directory silently loses the files left out: every tracked file of each source must get in."""
    patterns = dockerignore_patterns(verb)
    sources = [source for sources, _, _ in copy_instructions(verb) for source in sources]
    assert sources
    for source in sources:
        assert not dockerignored(source, patterns), f"{verb}.Dockerfile.dockerignore leaves out {source}"
        tracked = repository_files(source)
        assert tracked, f"{source} is not in the repository"
        left_out = [f for f in tracked if dockerignored(f, patterns)]
        assert not left_out, f"{verb}.Dockerfile.dockerignore leaves out {left_out[:5]}"


def test_scheduler_runs_from_the_files_of_its_image(tmp_path):
    """Only what scheduler.Dockerfile copies, laid out as in the image, with only the scheduler's
    dependencies importable (no torch, no numpy, no executor_service): the ENTRYPOINT's CLI
    answers `--help`, every module of the copied packages imports, the embedded model's tokenizer
    loads, and the health probe runs."""
    docker = dockerfile("scheduler")
    image = tmp_path / "image"
    for destination, source in image_files("scheduler").items():
        target = image / destination.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    # `pip install -e .` ran where pyproject.toml was copied: that directory is on sys.path.
    (install,) = [d for d, s in image_files("scheduler").items() if s == ROOT / "pyproject.toml"]
    code = image / posixpath.dirname(install).lstrip("/")
    packages = sorted(p.name for p in code.iterdir() if (p / "__init__.py").is_file())
    assert "scheduler_service" in packages and "executor_service" not in packages
    home = image / docker.values("WORKDIR")[-1].lstrip("/")
    home.mkdir(parents=True, exist_ok=True)
    allowed = sorted(image_top_level_modules())
    assert "grpc" in allowed and "torch" not in allowed and "numpy" not in allowed
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(code),
        "PYTHONNOUSERSITE": "1",
        **docker.env,
    }
    argv = [*docker.exec_form("ENTRYPOINT"), *docker.exec_form("CMD"), "--help"]
    out = subprocess.run(
        [sys.executable, "-c", IMAGE_SCRIPT, json.dumps([allowed, packages, str(ROOT), str(code), argv])],
        env=env,
        cwd=home,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "usage: tandem scheduler" in out.stdout.replace("\n", " ") and "image ok" in out.stdout
    # The HEALTHCHECK's script, as copied: no service on the port, so it must answer UNAVAILABLE.
    (probe,) = [d for d in image_files("scheduler") if d.endswith("/" + docker.healthcheck[0])]
    from client.defaults import free_port

    port = free_port()
    out = subprocess.run(
        [sys.executable, str(image / probe.lstrip("/")), "scheduler", "--timeout", "1"],
        env={**env, "TANDEM_SCHEDULER_PORT": str(port)},
        cwd=home,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and f"127.0.0.1:{port}: UNAVAILABLE" in out.stderr, out.stdout + out.stderr
