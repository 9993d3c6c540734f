"""deploy/, the compose services and the Kubernetes containers, each with its Dockerfile's ENV, are parsed by the real CLI: every flag has an environment twin, containers set only variables the CLI reads, listen where they are exposed, probe through grpc.health.v1, point the scheduler at its executor, require the executor's key from a secret, and give the drain its grace.

No Docker engine is needed (tests/helpers/deploy.py reads the files); tests/test_deploy_prometheus.py
runs the services and a real Prometheus."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from helpers.deploy import (
    ALL_CONTAINERS,
    PROBES,
    VERBS,
    _env_value,
    _secret_source,
    cli_env_names,
    compose_containers,
    dockerfile,
    flag_environment,
    grace_seconds,
    health_probe_port,
    k8s_containers,
    k8s_documents,
    k8s_services,
    load_compose,
    parse_service_args,
    service_selects,
)

from protos.vllm_flags import ForeignAction


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
        # vLLM's flags that the service does not serve: refused, or accepted without effect.
        if not isinstance(found[0], (argparse._HelpAction, ForeignAction))
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
