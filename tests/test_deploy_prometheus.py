"""A real Prometheus scraping the two services, each started as its Dockerfile's ENTRYPOINT with
the image's ENV (ports, model and device overridden through TANDEM_* as `docker run -e` would),
with the scrape configuration and the alert rules of deploy/prometheus/.

One test, because the stack takes a few seconds to start and pytest-xdist would start it once
per worker for separate tests."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from helpers.deploy import (
    DEPLOY,
    PROMETHEUS_DIR,
    dashboard_queries,
    dockerfile,
    load_prometheus_config,
    promql_metric_names,
    require_tool,
    tandem_command,
)
from helpers.processes import ServiceProcess
from prometheus_client.parser import text_string_to_metric_families

from client import TandemClient, TandemError
from client.defaults import DEFAULT_MODEL, free_port

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def prometheus_installed() -> str:
    """Skips without the prometheus server, or fails where TANDEM_REQUIRE_PROMETHEUS is set (CI)."""
    return require_tool("prometheus")


STARTUP_TIMEOUT = 60.0
QUERY_TIMEOUT = 45.0
SCRAPE_INTERVAL = "1s"
# What Grafana substitutes for $__rate_interval: at least 4 scrape intervals.
RATE_INTERVAL = "5s"
PROMPTS = ["The list type", "Exceptions are", "A class definition", "The for statement"]


class Prometheus:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        argv = ["prometheus", f"--config.file={workdir / 'prometheus.yml'}"]
        argv += [f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address={self.address}"]
        self.service = ServiceProcess("prometheus", argv + ["--log.level=warn"], workdir / "prometheus.log")

    def start(self, config: dict) -> None:
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.service.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            assert self.service.alive(), self.service.tail()
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {STARTUP_TIMEOUT} s\n{self.service.tail()}")

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:  # a bad query: 400 with the parser's message
            body = json.load(e)
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait_for(self, expr: str, what: str) -> list[dict]:
        """The query's result once it is non-empty."""
        deadline = time.monotonic() + QUERY_TIMEOUT
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} after {QUERY_TIMEOUT} s: {expr}\n{self.service.tail()}")
            time.sleep(0.5)


def container_service(verb: str, overrides: dict[str, str], log_dir: Path) -> ServiceProcess:
    """The Dockerfile's ENTRYPOINT + CMD, with its ENV and then `overrides` (as `docker run -e`)."""
    docker = dockerfile(verb)
    entrypoint, cmd = docker.exec_form("ENTRYPOINT"), docker.exec_form("CMD")
    assert entrypoint[0] == "tandem"
    env = {**os.environ, **docker.env, "OMP_NUM_THREADS": "1", **overrides}
    return ServiceProcess(verb, tandem_command() + entrypoint[1:] + cmd, log_dir / f"{verb}.log", env=env)


def prometheus_config(targets: dict[str, str], rules: Path, self_target: str) -> dict:
    """deploy/prometheus/prometheus.yml with its targets on localhost and a 1 s scrape interval."""
    config = load_prometheus_config()
    config["global"].update(scrape_interval=SCRAPE_INTERVAL, evaluation_interval=SCRAPE_INTERVAL)
    config["rule_files"] = [str((PROMETHEUS_DIR / f).resolve()) for f in config["rule_files"]]
    assert rules.resolve() in {Path(f) for f in config["rule_files"]}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {*targets, "prometheus"}, "a new scrape job: give it a target here"
    for name, target in {**targets, "prometheus": self_target}.items():
        jobs[name]["static_configs"] = [{"targets": [target]}]
    return config


def scrape_sample_names(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def burst(address: str, stop: threading.Event) -> None:
    """Generations, 8 at a time, until stopped; each round also sends one invalid request."""
    with TandemClient(address) as client, ThreadPoolExecutor(8) as pool:
        while not stop.is_set():
            futures = [pool.submit(client.complete, PROMPTS[i % 4], max_tokens=24) for i in range(8)]
            # INVALID_ARGUMENT, counted in tandem_scheduler_requests_failed_total.
            with contextlib.suppress(TandemError):
                client.complete("The list type", temperature=-1.0)
            for f in futures:
                f.result()


def healthcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py"), *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_prometheus_scrapes_the_services_started_as_their_images_would(tmp_path):
    executor_port, executor_metrics = free_port(), free_port()
    scheduler_port, scheduler_metrics = free_port(), free_port()
    executor = container_service(
        "executor",
        {
            "TANDEM_EXECUTOR_PORT": str(executor_port),
            "TANDEM_EXECUTOR_METRICS_PORT": str(executor_metrics),
            "TANDEM_MODEL": str(DEFAULT_MODEL),
            "TANDEM_DEVICE": "cpu",
            "TANDEM_NUM_KV_BLOCKS": "256",
            "TANDEM_MAX_NUM_SEQS": "16",
        },
        tmp_path,
    )
    scheduler = container_service(
        "scheduler",
        {
            "TANDEM_SCHEDULER_PORT": str(scheduler_port),
            "TANDEM_SCHEDULER_METRICS_PORT": str(scheduler_metrics),
            "TANDEM_EXECUTOR_ADDRESS": f"127.0.0.1:{executor_port}",
        },
        tmp_path,
    )
    rules = PROMETHEUS_DIR / "alerts.yml"
    (tmp_path / "prometheus").mkdir()
    prometheus = Prometheus(tmp_path / "prometheus")
    stop_burst = threading.Event()
    burst_thread = threading.Thread(
        target=burst, args=(f"127.0.0.1:{scheduler_port}", stop_burst), daemon=True
    )
    try:
        executor.start()
        scheduler.start()
        for service, port in ((executor, executor_port), (scheduler, scheduler_port)):
            with TandemClient(f"127.0.0.1:{port}") as client:
                try:
                    client.wait_until_serving(STARTUP_TIMEOUT)
                except TandemError as e:
                    raise AssertionError(f"{service.name}: {e}\n{service.tail(40)}") from None

        # The images' health probe, against the services (port from the same TANDEM_* variables).
        for verb, port in (("executor", executor_port), ("scheduler", scheduler_port)):
            out = healthcheck(verb, env={f"TANDEM_{verb.upper()}_PORT": str(port)})
            assert out.returncode == 0 and "SERVING" in out.stdout, out.stdout + out.stderr
        out = healthcheck("--address", f"127.0.0.1:{free_port()}", "--timeout", "1")
        assert out.returncode == 1 and "UNAVAILABLE" in out.stderr

        targets = {
            "tandem-scheduler": f"127.0.0.1:{scheduler_metrics}",
            "tandem-executor": f"127.0.0.1:{executor_metrics}",
        }
        prometheus.start(prometheus_config(targets, rules, prometheus.address))
        burst_thread.start()

        # Both targets up, with the job names the alert rules and the dashboard use.
        prometheus.wait_for('count(up{job=~"tandem-scheduler|tandem-executor"} == 1) == 2', "targets up")

        throughput = prometheus.wait_for(
            'sum(rate(tandem_scheduler_generation_tokens_total{job="tandem-scheduler"}[5s])) > 0',
            "generated tokens",
        )
        assert float(throughput[0]["value"][1]) > 0
        kv = prometheus.wait_for('tandem_scheduler_kv_cache_usage_ratio{job="tandem-scheduler"}', "KV usage")
        assert 0.0 <= float(kv[0]["value"][1]) <= 1.0
        steps = prometheus.wait_for(
            'sum by (kind) (tandem_executor_step_duration_seconds_count{job="tandem-executor"}) > 0',
            "executor steps",
        )
        assert {"prefill", "decode"} <= {r["metric"]["kind"] for r in steps}
        buckets = prometheus.query(
            'tandem_executor_step_duration_seconds_bucket{job="tandem-executor", kind="decode"}'
        )
        assert len({r["metric"]["le"] for r in buckets}) > 5 and "+Inf" in {
            r["metric"]["le"] for r in buckets
        }

        # The alert rules loaded and evaluate without errors.
        deadline = time.monotonic() + QUERY_TIMEOUT
        while True:
            loaded = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
            if loaded and all(r["health"] == "ok" for r in loaded):
                break
            assert time.monotonic() < deadline, f"rules not healthy: {loaded}"
            time.sleep(0.5)
        shipped = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]}
        assert {r["name"] for r in loaded} == shipped

        # Every dashboard query names only metrics the services export, and returns data.
        exported = scrape_sample_names(scheduler_metrics) | scrape_sample_names(executor_metrics)
        for title, expr in dashboard_queries():
            names = promql_metric_names(expr)
            assert names and names <= exported, f"panel {title!r} queries {sorted(names - exported)}"
            prometheus.wait_for(expr.replace("$__rate_interval", RATE_INTERVAL), f"data for panel {title!r}")
    finally:
        stop_burst.set()
        if burst_thread.is_alive():
            burst_thread.join(30)
        for service in (scheduler, executor, prometheus.service):
            service.stop(15.0)
    # SIGTERM reached the process the entrypoint started, which drained and exited cleanly.
    for service in (scheduler, executor):
        assert service.process.returncode == 0, (
            f"{service.name} exited {service.process.returncode}\n{service.tail()}"
        )
