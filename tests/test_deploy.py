"""deploy/: the Dockerfiles' entrypoints run as written, the compose file and the Kubernetes
manifests agree with what the services listen on and with the environment the CLI reads, the
alert rules pass promtool, and the dashboard queries only metrics the services export.

No Docker engine is needed: containers are described by their Dockerfile (ENTRYPOINT, CMD, ENV,
EXPOSE) plus what compose or Kubernetes adds, and their command line is parsed by the real CLI
with the container's environment. tests/test_deploy_prometheus.py runs the services and a real
Prometheus."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
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

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not found (Debian package `prometheus`; .ci/run installs it)",
)


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

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
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
            env = {e["name"]: str(e["value"]) for e in c.get("env", [])}
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
        if "prometheus.io/port" in service["metadata"].get("annotations", {}):
            assert int(service["metadata"]["annotations"]["prometheus.io/port"]) in {
                c.args().metrics_port for c in selected
            }


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


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    queries = []
    for panel in load_dashboard()["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    return queries


def test_dashboard_is_valid_and_uses_the_provisioned_datasource():
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
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
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, sum by (job, le) (rate(tandem_scheduler_time_to_first_token" in exprs
    assert "sum by (kind, le) (rate(tandem_executor_step_duration_seconds_bucket" in exprs
