"""deploy/, Prometheus and Grafana: the scrape config, promtool's check and test of the alert rules (each alert firing and quiet), the dashboard's JSON, and every queried metric is one the services export.

No Docker engine is needed (tests/helpers/deploy.py reads the files); tests/test_deploy_prometheus.py
runs the services and a real Prometheus."""

from __future__ import annotations

import pytest
import yaml
from helpers.deploy import (
    DEPLOY,
    PROMETHEUS_DIR,
    PROMETHEUS_SERIES,
    QUERIES,
    compose_containers,
    dashboard_panels,
    dashboard_queries,
    exposed_names,
    load_compose,
    load_dashboard,
    load_prometheus_config,
    promql_metric_names,
    promtool,
    require_tool,
    service_metric_names,
)


@pytest.fixture
def promtool_installed() -> str:
    return require_tool("promtool")


needs_promtool = pytest.mark.usefixtures("promtool_installed")


def test_prometheus_scrapes_both_services_on_their_metrics_ports():
    jobs = {j["job_name"]: j for j in load_prometheus_config()["scrape_configs"]}
    for c in compose_containers():
        (target,) = jobs[f"tandem-{c.verb}"]["static_configs"][0]["targets"]
        host, port = target.split(":")
        assert host == c.where.removeprefix("compose:") and int(port) == c.args().metrics_port
    prometheus = load_compose()["services"]["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in prometheus["volumes"]


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


def test_promql_metric_names():
    expr = (
        'histogram_quantile(0.99, sum by (kind, le) (rate(tandem_executor_step_duration_seconds_bucket{kind="decode"}[$__rate_interval])))'
        ' / on (instance) group_left sum(rate(x_total[5m] offset 1m)) > 1e3 and up{job=~"a|b"} == 0'
    )
    assert promql_metric_names(expr) == {"tandem_executor_step_duration_seconds_bucket", "x_total", "up"}


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


def test_exposed_names():
    text = (
        "# HELP a_total A\n# TYPE a_total counter\na_total 1.0\n"
        "# HELP b_total B\n# TYPE b_total counter\n"
        '# HELP h H\n# TYPE h histogram\nh_bucket{le="+Inf"} 0.0\nh_count 0.0\nh_sum 0.0\n'
        "# HELP g G\n# TYPE g gauge\n"
    )
    assert exposed_names(text) == {"a_total", "b_total", "h_bucket", "h_count", "h_sum", "g"}


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
