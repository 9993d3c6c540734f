"""deploy/: the Dockerfiles' entrypoints run as written, the compose file and the Kubernetes
manifests agree with what the services listen on and with the environment the CLI reads, the
alert rules pass promtool, and the dashboard queries only metrics the services export.

No Docker engine is needed: containers are described by their Dockerfile (ENTRYPOINT, CMD, ENV,
EXPOSE) plus what compose or Kubernetes adds, and their command line is parsed by the real CLI
with the container's environment. tests/test_deploy_prometheus.py runs the services and a real
Prometheus."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tandem.json"
VERBS = ("executor", "scheduler")
# Images the compose file may use besides ours.
THIRD_PARTY_IMAGES = {"prom/prometheus", "grafana/grafana"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def prometheus_required() -> bool:
    """.ci/run sets TANDEM_REQUIRE_PROMETHEUS=1: there the tests that need promtool or prometheus
    fail when it is missing; elsewhere they skip."""
    return os.environ.get("TANDEM_REQUIRE_PROMETHEUS", "").strip() not in {"", "0"}


def require_tool(name: str) -> str:
    """The path of `name` (promtool, prometheus); skip without it, or fail where it is required."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found (Debian package `prometheus`; .ci/run installs it)"
        if prometheus_required():
            pytest.fail(f"{message}, and TANDEM_REQUIRE_PROMETHEUS is set", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture
def promtool_installed() -> str:
    return require_tool("promtool")


needs_promtool = pytest.mark.usefixtures("promtool_installed")


# --- Dockerfiles --------------------------------------------------------------------------------


@dataclass
class Dockerfile:
    path: Path
    instructions: list[tuple[str, str]]

    def values(self, name: str) -> list[str]:
        return [rest for instruction, rest in self.instructions if instruction == name]

    def exec_form(self, name: str) -> list[str]:
        """ENTRYPOINT / CMD as a JSON array (the exec form); [] when absent."""
        found = self.values(name)
        if not found:
            return []
        value = json.loads(found[-1])
        assert isinstance(value, list), f"{self.path.name}: {name} is not in exec form"
        return value

    @property
    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for rest in self.values("ENV"):
            words = shlex.split(rest)
            if "=" not in words[0]:  # the legacy form: ENV KEY value
                env[words[0]] = " ".join(words[1:])
                continue
            for word in words:
                key, _, value = word.partition("=")
                env[key] = value
        return env

    @property
    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for rest in self.values("EXPOSE") for p in rest.split()}

    @property
    def healthcheck(self) -> list[str]:
        (rest,) = self.values("HEALTHCHECK")
        return json.loads(rest.split("CMD", 1)[1])


def parse_dockerfile(path: Path) -> Dockerfile:
    instructions, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        instruction, _, rest = line.partition(" ")
        instructions.append((instruction.upper(), rest.strip()))
    return Dockerfile(path, instructions)


def dockerfile(verb: str) -> Dockerfile:
    return parse_dockerfile(DEPLOY / f"{verb}.Dockerfile")


def image_of(verb: str) -> str:
    """The name each Dockerfile's image is built and referenced under."""
    return f"tandem-{verb}"


def image_name(image: str) -> str:
    """registry/name:tag -> name (what kustomize's `images:` matches on)."""
    return image.rsplit("/", 1)[-1].split(":")[0]


def tandem_command() -> list[str]:
    """`tandem` as installed with this interpreter, or the same entry point through `-m`."""
    script = Path(sys.executable).with_name("tandem")
    return [str(script)] if script.exists() else [sys.executable, "-m", "client.cli"]


# --- The CLI as a container would run it ---------------------------------------------------------


class _RecordingEnviron(dict):
    """os.environ stand-in that remembers every variable looked up."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()
        self.log: list[str] = []  # every lookup, in order

    def _record(self, key) -> None:
        self.read.add(key)
        self.log.append(key)

    def get(self, key, default=None):
        self._record(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)


def _with_environ(env: dict[str, str], fn):
    recording, saved = _RecordingEnviron(env), os.environ
    os.environ = recording  # noqa: B003 (only lookups are replaced, nothing is exported)
    try:
        return fn(), recording.read
    finally:
        os.environ = saved  # noqa: B003


def parse_tandem(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """`tandem argv...` parsed by the real CLI with `env` as the whole environment."""
    from client.cli import build_parser

    parser, _ = _with_environ(env, lambda: build_parser(argv))
    return parser.parse_args(argv)


def parse_service_args(verb: str, argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    return parse_tandem([verb, *argv], env)


def cli_env_names(verb: str) -> set[str]:
    """The TANDEM_* variables `tandem <verb>` reads: its own flags' twins and the global ones."""
    from client.cli import build_parser

    module = importlib.import_module(f"{verb}_service.cli")
    _, own = _with_environ({}, lambda: module.add_arguments(argparse.ArgumentParser()))
    _, everything = _with_environ({}, lambda: build_parser([verb]))
    global_names = {"TANDEM_LOG_LEVEL"} & everything
    return {n for n in own | global_names if n.startswith("TANDEM_")}


def flag_environment(verb: str) -> dict[str, tuple[argparse.Action, list[str]]]:
    """option string -> (its action, the TANDEM_* variables read for it), for every flag of
    `tandem <verb>`: its own (`add_arguments`) and the global ones of `tandem`. A variable counts
    for the flag whose add_argument call follows the lookup (a default is evaluated just before)."""
    from client.cli import build_parser

    reads: dict[argparse.Action, list[str]] = {}
    original = argparse._ActionsContainer.add_argument
    recording = _RecordingEnviron({})
    consumed = 0

    def add_argument(self, *args, **kwargs):
        nonlocal consumed
        action = original(self, *args, **kwargs)
        reads[action] = [n for n in recording.log[consumed:] if n.startswith("TANDEM_")]
        consumed = len(recording.log)
        return action

    saved = os.environ
    argparse._ActionsContainer.add_argument = add_argument
    os.environ = recording  # noqa: B003 (only lookups are replaced, nothing is exported)
    try:
        parser = build_parser([verb])
    finally:
        os.environ = saved  # noqa: B003
        argparse._ActionsContainer.add_argument = original
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    actions = [a for a in parser._actions + subparsers.choices[verb]._actions if a.option_strings]
    return {a.option_strings[0]: (a, reads[a]) for a in actions}


def _env_value(action: argparse.Action, default):
    """A value for the flag's variable that differs from its default: (text, parsed value)."""
    if action.nargs == 0:  # store_true / store_false
        return "1", not default
    if action.choices:
        choice = next(c for c in action.choices if c != default)
        return str(choice), choice
    if action.type is int:
        return "7", 7
    if action.type is float:
        return "7.5", 7.5
    assert action.type is None, f"{action.option_strings}: no test value for type {action.type}"
    return "/srv/from-the-environment", "/srv/from-the-environment"


@pytest.mark.parametrize("verb", VERBS)
def test_every_flag_has_an_environment_twin(verb):
    """Each flag of the service can be set through a TANDEM_* variable (the only way a container
    orchestrator sets most of them), and its help names the variable."""
    # The scheduler cannot start without an executor address: the one flag given in every run.
    base = {"TANDEM_EXECUTOR_ADDRESS": "executor:50052"} if verb == "scheduler" else {}
    defaults = parse_service_args(verb, [], base)
    flags = {
        flag: found
        for flag, found in flag_environment(verb).items()
        if not isinstance(found[0], argparse._HelpAction)
    }
    assert {"--host", "--port", "--metrics-port", "--log-level"} <= set(flags)
    for flag, (action, names) in flags.items():
        assert names, f"tandem {verb} {flag} reads no TANDEM_* variable"
        documented = set(re.findall(r"TANDEM_[A-Z0-9_]+", action.help or ""))
        assert documented & set(names), f"{flag}: its help names none of {names}"
        for name in names:
            text, expected = _env_value(action, getattr(defaults, action.dest))
            args = parse_service_args(verb, [], {**base, name: text})
            assert getattr(args, action.dest) == expected, f"{name}={text} does not set {flag}"


def test_flag_environment_finds_every_variable():
    executor = flag_environment("executor")
    assert executor["--model"][1] == ["TANDEM_MODEL"] and executor["--grace"][1] == ["TANDEM_EXECUTOR_GRACE"]
    assert executor["--enforce-eager"][1] == ["TANDEM_ENFORCE_EAGER"]
    assert executor["-h"][1] == [] and "--device" in executor and "--tls-ca" in executor
    scheduler = flag_environment("scheduler")
    assert scheduler["--executor"][1] == ["TANDEM_EXECUTOR_ADDRESS"]
    assert scheduler["--log-level"][1] == ["TANDEM_LOG_LEVEL"]


def test_cli_env_names_are_collected():
    executor, scheduler = cli_env_names("executor"), cli_env_names("scheduler")
    assert {"TANDEM_MODEL", "TANDEM_EXECUTOR_HOST", "TANDEM_EXECUTOR_PORT", "TANDEM_LOG_LEVEL"} <= executor
    assert {"TANDEM_EXECUTOR_ADDRESS", "TANDEM_SCHEDULER_HOST", "TANDEM_TOKENIZER"} <= scheduler
    assert "TANDEM_MODEL" not in scheduler and "TANDEM_SCHEDULER_PORT" not in executor


# --- Containers as compose and Kubernetes define them ---------------------------------------------


@dataclass
class Container:
    layout: str  # "compose", "k8s" (one pair) or "k8s/replicas" (a pair per pod)
    where: str  # "compose:executor", "k8s/executor.yaml:tandem-executor/executor"
    verb: str
    image: str
    env: dict[str, str]  # set by compose / Kubernetes (the Dockerfile's ENV not included)
    argv: list[str]  # after the Dockerfile's ENTRYPOINT
    ports: set[int]
    raw: dict = field(repr=False, default_factory=dict)
    pod: dict = field(repr=False, default_factory=dict)  # Kubernetes: the pod spec
    pod_metadata: dict = field(repr=False, default_factory=dict)  # and its labels, annotations

    @property
    def full_env(self) -> dict[str, str]:
        return {**dockerfile(self.verb).env, **self.env}

    def args(self) -> argparse.Namespace:
        return parse_service_args(self.verb, self.argv, self.full_env)


def load_compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def compose_containers() -> list[Container]:
    containers = []
    for name, service in load_compose()["services"].items():
        if image_name(service["image"]).split("/")[-1] not in {image_of(v) for v in VERBS}:
            continue
        verb = image_name(service["image"]).removeprefix("tandem-")
        docker = dockerfile(verb)
        command = service.get("command", docker.exec_form("CMD"))
        command = shlex.split(command) if isinstance(command, str) else command
        ports = {int(str(p).split("/")[0]) for p in service.get("expose", [])}
        ports |= {int(str(p).split(":")[-1].split("/")[0]) for p in service.get("ports", [])}
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        containers.append(
            Container("compose", f"compose:{name}", verb, service["image"], env, command, ports, service)
        )
    return containers


def k8s_documents() -> Iterator[tuple[Path, dict]]:
    for path in sorted((DEPLOY / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def _k8s_env_value(entry: dict) -> str:
    """A variable's value, or for one from a Secret `secret:<name>/<key>` (what the CLI then sees)."""
    if "value" in entry:
        return str(entry["value"])
    ref = entry["valueFrom"]["secretKeyRef"]
    return f"secret:{ref['name']}/{ref['key']}"


def k8s_containers() -> list[Container]:
    containers = []
    for path, doc in k8s_documents():
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            verb = image_name(c["image"]).removeprefix("tandem-")
            assert verb in VERBS, f"{path.name}: {c['name']} runs {c['image']}, not an image of deploy/"
            assert "command" not in c, f"{path.name}: {c['name']} replaces the Dockerfile's ENTRYPOINT"
            env = {e["name"]: _k8s_env_value(e) for e in c.get("env", [])}
            argv = c.get("args", dockerfile(verb).exec_form("CMD"))
            ports = {p["containerPort"] for p in c.get("ports", [])}
            where = f"k8s/{path.relative_to(DEPLOY / 'k8s')}:{doc['metadata']['name']}/{c['name']}"
            metadata = doc["spec"]["template"]["metadata"]
            layout = str(path.parent.relative_to(DEPLOY))
            containers.append(Container(layout, where, verb, c["image"], env, argv, ports, c, pod, metadata))
    return containers


ALL_CONTAINERS = compose_containers() + k8s_containers()


def test_every_layout_has_both_services():
    layouts: dict[str, list[str]] = {}
    for c in ALL_CONTAINERS:
        layouts.setdefault(c.layout, []).append(c.verb)
    # One executor and one scheduler in each: a scheduler owns its executor's KV cache.
    assert {k: sorted(v) for k, v in layouts.items()} == {
        "compose": sorted(VERBS),
        "k8s": sorted(VERBS),
        "k8s/replicas": sorted(VERBS),
    }


@pytest.mark.parametrize("container", ALL_CONTAINERS, ids=lambda c: c.where)
def test_container_sets_only_variables_the_cli_reads(container):
    allowed = cli_env_names(container.verb)
    unknown = {k for k in container.full_env if k.startswith("TANDEM_")} - allowed
    assert not unknown, (
        f"{container.where} sets {sorted(unknown)}; tandem {container.verb} reads {sorted(allowed)}"
    )


def _secret_source(container: Container, variable: str) -> str | None:
    """Where the container's `variable` comes from when it is a secret: the Kubernetes Secret key
    (`secret:<name>/<key>`), or the compose variable that must be set (`${NAME:?...}`, no default);
    None for a literal or for nothing."""
    value = container.env.get(variable)
    if value is None:
        return None
    if container.layout == "compose":
        match = re.fullmatch(r"\$\{(\w+):\?[^}]*\}", value)
        return f"compose:${match.group(1)}" if match else None
    return value if value.startswith("secret:") else None


@pytest.mark.parametrize(
    "container", [c for c in ALL_CONTAINERS if c.verb == "executor"], ids=lambda c: c.where
)
def test_executor_is_not_drivable_without_the_secret(container, caplog):
    """Each shipped executor listens beyond loopback, so it must require an API key from a secret
    (or mutual TLS), its scheduler must send that same secret, and the executor must not warn that
    anyone could drive it."""
    args = container.args()
    assert args.api_key or args.api_key_file or args.tls_ca, f"{container.where}: anyone can drive it"
    if not args.tls_ca:
        variables = ("TANDEM_EXECUTOR_API_KEY", "TANDEM_EXECUTOR_API_KEY_FILE")
        sources = {v: _secret_source(container, v) for v in variables if v in container.env}
        assert sources and all(sources.values()), (
            f"{container.where}: the key is not from a secret: {sources}"
        )
        (scheduler,) = [c for c in ALL_CONTAINERS if c.verb == "scheduler" and c.layout == container.layout]
        assert {v: _secret_source(scheduler, v) for v in sources} == sources, scheduler.where
        sent = scheduler.args()
        assert (sent.executor_api_key, sent.executor_api_key_file) == (args.api_key, args.api_key_file)
    from executor_service.server import ExecutorServer

    with caplog.at_level("WARNING", logger="executor_service.server"):
        ExecutorServer(
            args.host, 0, mutual_tls=bool(args.tls_ca), api_keys=[args.api_key] if args.api_key else None
        ).stop(0)
    assert "drive the executor" not in caplog.text


@pytest.mark.parametrize("container", ALL_CONTAINERS, ids=lambda c: c.where)
def test_container_listens_where_it_is_exposed(container):
    args = container.args()  # the real CLI, the container's environment and arguments
    assert args.host == "0.0.0.0", f"{container.where} binds {args.host}: unreachable from outside"
    assert {args.port, args.metrics_port} <= container.ports, container.where
    assert {args.port, args.metrics_port} <= dockerfile(container.verb).exposed
    if container.verb == "executor":
        assert Path(args.model).is_absolute() and args.model.startswith("/models/")
        assert args.device == "cuda"


@pytest.mark.parametrize(
    "container", [c for c in ALL_CONTAINERS if c.verb == "scheduler"], ids=lambda c: c.where
)
def test_scheduler_points_at_its_executor(container):
    host, port = container.args().executor.rsplit(":", 1)
    executors = [c for c in ALL_CONTAINERS if c.verb == "executor" and c.layout == container.layout]
    (executor,) = executors
    if container.where.startswith("compose:"):
        assert (
            host in load_compose()["services"] and load_compose()["services"][host]["image"] == executor.image
        )
        assert int(port) == executor.args().port
    elif executor.pod is container.pod:  # a sidecar: over localhost
        assert host == "127.0.0.1" and int(port) == executor.args().port
    else:  # through the executor's Service
        service = k8s_services()[host]
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}
        target = next(p["targetPort"] for p in service["spec"]["ports"] if p["port"] == int(port))
        named = {p["name"]: p["containerPort"] for p in executor.raw["ports"]}
        assert named.get(target, target) == executor.args().port
        assert service_selects(service, executor)


@pytest.mark.parametrize("container", ALL_CONTAINERS, ids=lambda c: c.where)
def test_probes_use_the_grpc_health_service(container):
    args = container.args()
    if container.where.startswith("compose:"):
        check = container.raw["healthcheck"]["test"]
        assert check == ["CMD", *dockerfile(container.verb).healthcheck]
        assert health_probe_port(container.verb, container.full_env) == args.port
    else:
        for name in PROBES:
            probe = container.raw[name]
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, (container.where, name)
            assert probe["grpc"]["port"] == args.port, (container.where, name)


def test_compose_scheduler_waits_for_a_healthy_executor():
    """The scheduler starts once the executor's health probe passes (model loaded, SERVING), not
    merely once its container has started."""
    services = load_compose()["services"]
    (executor,) = [c for c in compose_containers() if c.verb == "executor"]
    executor_name = executor.where.removeprefix("compose:")
    for scheduler in (c for c in compose_containers() if c.verb == "scheduler"):
        depends_on = scheduler.raw["depends_on"]
        assert isinstance(depends_on, dict), f"{scheduler.where}: depends_on needs the long form"
        assert depends_on[executor_name]["condition"] == "service_healthy", scheduler.where
    healthcheck = services[executor_name]["healthcheck"]
    assert healthcheck["test"] == ["CMD", *dockerfile("executor").healthcheck]
    assert not healthcheck.get("disable", False)
    # Loading a large checkpoint takes minutes: failed probes before then do not count.
    start_period = healthcheck["start_period"]
    assert start_period.endswith("s") and int(start_period[:-1]) >= 60


def test_dockerfile_healthchecks_probe_the_service_port():
    for verb in VERBS:
        docker = dockerfile(verb)
        assert docker.healthcheck == ["tandem-healthcheck", verb]
        assert "deploy/healthcheck.py /usr/local/bin/tandem-healthcheck" in " ".join(docker.values("COPY"))
        args = parse_service_args(verb, docker.exec_form("CMD"), docker.env)
        assert health_probe_port(verb, docker.env) == args.port


def health_probe_port(verb: str, env: dict[str, str]) -> int:
    """The port deploy/healthcheck.py checks for `verb` in a container with `env`."""
    spec = importlib.util.spec_from_file_location("tandem_healthcheck", DEPLOY / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name, default = module.PORTS[verb]
    return int(env.get(name, default))


def grace_seconds(container: Container) -> float:
    """What the container's `--grace` is set to (the flag's dest differs between CLI versions)."""
    parser = argparse.ArgumentParser()
    importlib.import_module(f"{container.verb}_service.cli").add_arguments(parser)
    (action,) = [a for a in parser._actions if "--grace" in a.option_strings]
    return getattr(container.args(), action.dest)


@pytest.mark.parametrize("container", ALL_CONTAINERS, ids=lambda c: c.where)
def test_termination_grace_covers_the_drain(container):
    if container.layout == "compose":
        stop = container.raw["stop_grace_period"]
        assert stop.endswith("s") and int(stop[:-1]) > grace_seconds(container), container.where
        return
    # The containers of a pod drain in turn (a sidecar executor stops after its scheduler).
    pod_grace = sum(grace_seconds(c) for c in k8s_containers() if c.pod == container.pod)
    assert container.pod["terminationGracePeriodSeconds"] > pod_grace, container.where


def test_executors_get_a_gpu_and_shared_memory():
    compose = load_compose()["services"]
    executor = next(s for s in compose.values() if s["image"].startswith("tandem-executor"))
    (device,) = executor["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert executor["shm_size"]
    for c in k8s_containers():
        resources = c.raw["resources"]
        assert resources["requests"].get("cpu") and resources["requests"].get("memory"), c.where
        if c.verb != "executor":
            assert "nvidia.com/gpu" not in resources.get("limits", {}), c.where
            continue
        assert resources["limits"]["nvidia.com/gpu"] >= 1, c.where
        shm = next(m for m in c.raw["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in c.pod["volumes"] if v["name"] == shm["name"])
        assert volume["emptyDir"]["medium"] == "Memory", c.where
        if "restartPolicy" in c.raw:  # a native sidecar, started before (stopped after) its scheduler
            assert c.raw["restartPolicy"] == "Always" and c.raw in c.pod["initContainers"]


def test_pods_run_as_non_root_without_service_links():
    for verb in VERBS:
        users = dockerfile(verb).values("USER")
        assert users and users[-1] not in {"root", "0"}, f"{verb}.Dockerfile runs as root"
    for path, doc in k8s_documents():
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, path.name
            # Service links would define TANDEM_<SERVICE>_PORT=tcp://..., which the CLI reads.
            assert pod["enableServiceLinks"] is False, path.name


# --- Images ---------------------------------------------------------------------------------------


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


# --- What each image holds -----------------------------------------------------------------------


def compile_dockerignore(lines: list[str]) -> list[tuple[bool, re.Pattern]]:
    """(re-included, regex) for each pattern of a .dockerignore, as Docker's patternmatcher reads
    it: `**` any number of directories, `*` and `?` within one path element, `!` re-includes."""
    patterns = []
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = posixpath.normpath(line.removeprefix("!").strip()).lstrip("/")
        assert "[" not in line and "\\" not in line, f"character classes are not modelled: {line}"
        regex = ""
        for part in re.split(r"(\*\*/|\*\*|\*|\?)", line):
            regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
        patterns.append((negated, re.compile(regex)))
    return patterns


def dockerignore_patterns(verb: str) -> list[tuple[bool, re.Pattern]]:
    """deploy/<verb>.Dockerfile.dockerignore, which BuildKit reads instead of the context's."""
    return compile_dockerignore((DEPLOY / f"{verb}.Dockerfile.dockerignore").read_text().splitlines())


def dockerignored(path: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether the build context leaves `path` out: Docker's rule, the last pattern that matches the
    path or one of its parent directories decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, regex in patterns:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


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


def copy_instructions(verb: str) -> list[tuple[list[str], str, bool]]:
    """(sources in the build context, absolute destination, destination is a directory) for each
    COPY of deploy/<verb>.Dockerfile, with WORKDIR applied."""
    workdir, copies = "/", []
    for instruction, rest in dockerfile(verb).instructions:
        if instruction == "WORKDIR":
            workdir = posixpath.join(workdir, rest)
        elif instruction == "COPY":
            words = shlex.split(rest)
            flags = [w for w in words if w.startswith("--")]
            assert not [f for f in flags if f.startswith("--from")], f"{verb}: COPY --from is not modelled"
            *sources, dest = [w for w in words if not w.startswith("--")]
            is_dir = dest.endswith("/") or len(sources) > 1
            copies.append((sources, posixpath.normpath(posixpath.join(workdir, dest)), is_dir))
    return copies


def image_files(verb: str) -> dict[str, Path]:
    """Path in the image -> file of this checkout, for everything the Dockerfile's COPY lines put
    in the image, after the Dockerfile's .dockerignore (what `docker build` would send)."""
    patterns = dockerignore_patterns(verb)
    files: dict[str, Path] = {}
    for sources, dest, dest_is_dir in copy_instructions(verb):
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"{verb}.Dockerfile copies {source}, which does not exist"
            if path.is_dir():  # its contents, into dest
                for f in sorted(path.rglob("*")):
                    relative = f.relative_to(ROOT).as_posix()
                    if f.is_file() and not dockerignored(relative, patterns):
                        files[posixpath.join(dest, f.relative_to(path).as_posix())] = f
            else:
                assert not dockerignored(source, patterns), f"{source}: left out of the context"
                files[posixpath.join(dest, path.name) if dest_is_dir else dest] = path
    return files


def repository_files(source: str) -> list[str]:
    """The files of the repository under `source` (git's list; without git, those on disk)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", source], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return [f for f in out.stdout.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        path = ROOT / source
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        return [f.relative_to(ROOT).as_posix() for f in files if f.is_file() and "__pycache__" not in f.parts]


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


def image_distributions() -> set[str]:
    """The distributions `pip install .` (no extras) puts in the scheduler image: pyproject's
    dependencies and theirs, as installed here."""
    import importlib.metadata as metadata

    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pending = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    seen: set[str] = set()
    while pending:
        requirement = Requirement(pending.pop())
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name not in seen:
            seen.add(name)
            pending.extend(metadata.requires(name) or [])
    return seen


def image_top_level_modules() -> set[str]:
    import importlib.metadata as metadata

    from packaging.utils import canonicalize_name

    distributions = image_distributions()
    return {
        module
        for module, dists in metadata.packages_distributions().items()
        if any(canonicalize_name(d) in distributions for d in dists)
    }


IMAGE_SCRIPT = r"""
import importlib, importlib.abc, json, pkgutil, sys
from pathlib import Path

allowed, packages, repository, code, argv = json.loads(sys.argv[1])
allowed = set(allowed) | set(packages) | set(sys.stdlib_module_names)


class OnlyTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in allowed:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)", name=name)
        return None


sys.meta_path.insert(0, OnlyTheImage())
sys.argv = argv
from client.cli import main

try:
    status = main()
except SystemExit as e:
    status = e.code
assert status == 0, f"{argv} exited {status}"
for package in packages:
    module = importlib.import_module(package)
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        if not info.name.endswith(".__main__"):
            importlib.import_module(info.name)
ours = {p.name for p in Path(repository).iterdir() if (p / "__init__.py").is_file()}
outside = sorted(
    name
    for name, module in list(sys.modules.items())
    if name.split(".")[0] in ours
    and not Path(getattr(module, "__file__", None) or code).resolve().is_relative_to(code)
)
assert not outside, f"imported from outside the image's code: {outside}"
assert "torch" not in sys.modules and "executor_service" not in sys.modules
# The embedded model's tokenizer, which the scheduler uses when the executor serves that model.
from client.defaults import DEFAULT_MODEL
from scheduler_service.tokenizer import Tokenizer

assert Path(DEFAULT_MODEL).resolve().is_relative_to(code), DEFAULT_MODEL
assert Tokenizer(DEFAULT_MODEL).decode(Tokenizer(DEFAULT_MODEL).encode("The list type")) == "The list type"
print("image ok")
"""


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


# --- Kubernetes Services, annotations, ServiceMonitor ---------------------------------------------


def k8s_services() -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in k8s_documents() if doc["kind"] == "Service"}


def service_selects(service: dict, container: Container) -> bool:
    labels = container.pod_metadata["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_k8s_services_reach_the_ports_the_containers_listen_on():
    services = k8s_services()
    containers = k8s_containers()
    for name, service in services.items():
        selected = [c for c in containers if service_selects(service, c)]
        assert selected, f"Service {name} selects no tandem container"
        named = {p["name"]: p["containerPort"] for c in selected for p in c.raw["ports"]}
        listening = {port for c in selected for a in [c.args()] for port in (a.port, a.metrics_port)}
        for port in service["spec"]["ports"]:
            target = named.get(port["targetPort"], port["targetPort"])
            assert target in listening, (name, port)
        # Scraped once: by its pods' annotations or its ServiceMonitor, never also by the Service's.
        assert "prometheus.io/scrape" not in service["metadata"].get("annotations", {}), name


def test_k8s_scrape_annotations_name_the_metrics_port():
    for c in k8s_containers():
        annotations = c.pod_metadata.get("annotations", {})
        if c.where.startswith("k8s/replicas/"):
            continue  # two metrics ports in one pod: the ServiceMonitor names both
        assert annotations["prometheus.io/scrape"] == "true", c.where
        assert int(annotations["prometheus.io/port"]) == c.args().metrics_port, c.where


def test_servicemonitors_scrape_every_metrics_port_with_the_alerts_job_names():
    services = k8s_services()
    monitors = [(p, d) for p, d in k8s_documents() if d["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    for path, monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        same_dir = {
            d["metadata"]["name"]
            for p, d in k8s_documents()
            if p.parent == path.parent and d["kind"] == "Service"
        }
        selected = [
            s
            for n, s in services.items()
            if n in same_dir and all(s["metadata"]["labels"].get(k) == v for k, v in selector.items())
        ]
        ports = {p["name"]: p for s in selected for p in s["spec"]["ports"]}
        jobs = set()
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in ports, (path, endpoint["port"])
            relabel = {r["targetLabel"]: r["replacement"] for r in endpoint.get("relabelings", [])}
            if "job" in relabel:
                jobs.add(relabel["job"])
            else:  # the operator's default job label: the Service's name
                jobs |= {
                    s["metadata"]["name"]
                    for s in selected
                    if endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
                }
        assert jobs == {"tandem-scheduler", "tandem-executor"}, path


# --- Prometheus configuration and rules -----------------------------------------------------------


def load_prometheus_config() -> dict:
    return yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())


def test_prometheus_scrapes_both_services_on_their_metrics_ports():
    jobs = {j["job_name"]: j for j in load_prometheus_config()["scrape_configs"]}
    for c in compose_containers():
        (target,) = jobs[f"tandem-{c.verb}"]["static_configs"][0]["targets"]
        host, port = target.split(":")
        assert host == c.where.removeprefix("compose:") and int(port) == c.args().metrics_port
    prometheus = load_compose()["services"]["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in prometheus["volumes"]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_check_config():
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout + out.stderr


@needs_promtool
def test_promtool_check_rules():
    out = promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_test_rules_covers_every_alert():
    out = promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    alerts = {
        r["alert"]
        for g in yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())["tests"]
    firing = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case["exp_alerts"]}
    quiet = {
        case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if not case["exp_alerts"]
    }
    assert alerts <= firing and alerts <= quiet, "each alert needs a firing and a quiet case"
    # An executor with no target left (no `up` series, so no instance label) is down too.
    assert any(
        "instance" not in alert["exp_labels"]
        for t in tests
        for case in t.get("alert_rule_test", [])
        if case["alertname"] == "TandemExecutorDown"
        for alert in case["exp_alerts"]
    ), "TandemExecutorDown needs a case where the executor's target is gone"
    assert {
        "TandemKVCacheNearlyFull",
        "TandemWaitingQueueGrowing",
        "TandemTimeToFirstTokenHigh",
        "TandemExecutorDown",
    } <= alerts


# --- Grafana ----------------------------------------------------------------------------------------

PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label
    names (in `{...}` matchers or `by (...)` lists), durations or numbers."""
    expr = _STRINGS.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range / subquery durations
    expr = _LABEL_LISTS.sub(" ", expr)
    names = set()
    for m in _IDENT.finditer(expr):
        before = expr[m.start() - 1] if m.start() else " "
        after = expr[m.end() :].lstrip()
        if before.isdigit() or before == ".":  # 1e3, 0.5
            continue
        if after.startswith("(") or m.group() in PROMQL_KEYWORDS:
            continue
        names.add(m.group())
    return names


def test_promql_metric_names():
    expr = (
        'histogram_quantile(0.99, sum by (kind, le) (rate(tandem_executor_step_duration_seconds_bucket{kind="decode"}[$__rate_interval])))'
        ' / on (instance) group_left sum(rate(x_total[5m] offset 1m)) > 1e3 and up{job=~"a|b"} == 0'
    )
    assert promql_metric_names(expr) == {"tandem_executor_step_duration_seconds_bucket", "x_total", "up"}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict | None = None) -> list[dict]:
    """Every panel, with those nested in rows (a collapsed row holds its panels in `panels`)."""

    def walk(panels: list[dict]) -> Iterator[dict]:
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    return list(walk((dashboard or load_dashboard())["panels"]))


def dashboard_queries(dashboard: dict | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard_panels(dashboard) for t in p.get("targets", [])]


def test_dashboard_queries_include_collapsed_rows():
    def panel(id_: int, title: str, expr: str) -> dict:
        return {"id": id_, "type": "timeseries", "title": title, "targets": [{"expr": expr}]}

    dashboard = {
        "panels": [
            panel(1, "open", "a_total"),
            {"id": 2, "type": "row", "title": "open row", "collapsed": False, "panels": []},
            {
                "id": 3,
                "type": "row",
                "title": "folded",
                "collapsed": True,
                "panels": [panel(4, "inside", "b_total"), panel(5, "also inside", "c")],
            },
        ]
    }
    assert dashboard_queries(dashboard) == [("open", "a_total"), ("inside", "b_total"), ("also inside", "c")]
    assert [p["id"] for p in dashboard_panels(dashboard)] == [1, 2, 3, 4, 5]


def test_dashboard_is_valid_and_uses_the_provisioned_datasource():
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    ids = [p["id"] for p in dashboard_panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in dashboard_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"] and target["expr"].strip()
    grid = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]]
    assert len(grid) == len(set(grid)), "panels overlap"
    # Provisioning: the file provider reads the directory compose mounts the dashboards into.
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tandem.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{path}:ro" in load_compose()["services"]["grafana"]["volumes"]


def test_dashboard_covers_what_operators_watch():
    exprs = " ".join(e for _, e in dashboard_queries())
    for metric in (
        "tandem_scheduler_generation_tokens_total",
        "tandem_scheduler_prompt_tokens_total",
        "tandem_scheduler_requests_running",
        "tandem_scheduler_requests_waiting",
        "tandem_scheduler_kv_cache_usage_ratio",
        "tandem_scheduler_prefix_cache_hit_tokens_total",
        "tandem_scheduler_preemptions_total",
        "tandem_scheduler_time_to_first_token_seconds_bucket",
        "tandem_scheduler_inter_token_latency_seconds_bucket",
        "tandem_executor_step_duration_seconds_bucket",
        "tandem_executor_device_memory_used_bytes",
    ):
        assert metric in exprs, metric
    queries = dashboard_queries()
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            expr = (
                f"histogram_quantile({q}, sum by (job, le) "
                f"(rate(tandem_scheduler_{histogram}_bucket[$__rate_interval])))"
            )
            assert expr in (e for _, e in queries), expr
    assert "sum by (kind, le) (rate(tandem_executor_step_duration_seconds_bucket" in exprs
    # The prefix-cache hit rate: tokens served from the cache over tokens looked up in it.
    (hit_rate,) = [e for _, e in queries if "tandem_scheduler_prefix_cache_hit_tokens_total" in e]
    numerator, denominator = hit_rate.split(" / ")
    assert promql_metric_names(numerator) == {"tandem_scheduler_prefix_cache_hit_tokens_total"}
    assert promql_metric_names(denominator) == {"tandem_scheduler_prefix_cache_queried_tokens_total"}
    assert numerator.replace("hit", "queried") == denominator, "rate the two counters alike"


# --- Metric names, without Prometheus ---------------------------------------------------------------

# Series Prometheus adds to every target itself.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# The sample names a family of each type exposes (the text parser strips a counter's _total).
_TYPE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "untyped": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def exposed_names(text: str) -> set[str]:
    """The sample names of a /metrics text exposition, parsed by prometheus_client. A labelled
    family with no children yet (a counter of failures before the first one) has its # TYPE line
    but no sample: it counts with the names its type gives."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        implied = {family.name + suffix for suffix in _TYPE_SUFFIXES[family.type]}
        samples = {s.name for s in family.samples}
        assert samples <= implied, (family.name, family.type, samples)  # what `implied` relies on
        names |= samples or implied
    return names


@functools.cache
def service_metric_names() -> dict[str, set[str]]:
    """verb -> the sample names in the exposition of that service's metrics registry, built in
    this process the way each server builds it (no server, no Prometheus)."""
    from prometheus_client import generate_latest

    from executor_service.metrics import ExecutorMetrics
    from scheduler_service.metrics import SchedulerMetrics

    return {
        "scheduler": exposed_names(generate_latest(SchedulerMetrics().registry).decode()),
        "executor": exposed_names(generate_latest(ExecutorMetrics().registry).decode()),
    }


def test_exposed_names():
    text = (
        "# HELP a_total A\n# TYPE a_total counter\na_total 1.0\n"
        "# HELP b_total B\n# TYPE b_total counter\n"
        '# HELP h H\n# TYPE h histogram\nh_bucket{le="+Inf"} 0.0\nh_count 0.0\nh_sum 0.0\n'
        "# HELP g G\n# TYPE g gauge\n"
    )
    assert exposed_names(text) == {"a_total", "b_total", "h_bucket", "h_count", "h_sum", "g"}


def alert_rule_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    return [(r.get("alert") or r["record"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


QUERIES = [pytest.param(e, id=f"panel {title}") for title, e in dashboard_queries()] + [
    pytest.param(e, id=f"alert {name}") for name, e in alert_rule_exprs()
]


@pytest.mark.parametrize("expr", QUERIES)
def test_queried_metrics_are_exported(expr):
    """Every metric a dashboard panel or an alert rule queries is in the exposition of the service
    its name belongs to (histograms through their _bucket / _sum / _count series)."""
    exported = service_metric_names()
    names = promql_metric_names(expr)
    assert names, f"no metric in {expr}"
    for name in names - PROMETHEUS_SERIES:
        verb = name.split("_")[1] if name.startswith("tandem_") else None
        assert verb in exported, f"{name}: not a metric of either service ({expr})"
        assert name in exported[verb], f"{name} is not in the {verb}'s metrics ({expr})"
