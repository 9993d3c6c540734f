"""deploy/, Kubernetes Services, scrape annotations and ServiceMonitors reach the ports the containers listen on, under the job names the alerts use.

No Docker engine is needed (tests/helpers/deploy.py reads the files); tests/test_deploy_prometheus.py
runs the services and a real Prometheus."""

from __future__ import annotations

from helpers.deploy import k8s_containers, k8s_documents, k8s_services, service_selects


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
