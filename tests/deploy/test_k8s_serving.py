"""deploy/k8s/ as something that serves (issue 38): the HTTP front end's Deployment and Service
(liveness /version, readiness /health), the scheduler's metrics off port 8000, the
ServiceMonitor that scrapes them, the workers' disruption budgets and their autoscaling on
vllm:num_requests_waiting (KEDA ScaledObjects), and the clients' API keys from an optional
Secret. Offline: the objects are read from the manifests, environments parsed by each
service's own flags, the metric names taken from the scheduler's own exposition.
"""

import os
import re
from typing import Any

import pytest

from tests.deploy.manifests import (
    K8S,
    Doc,
    Objects,
    container,
    deployment,
    env_of,
    resolved_env,
)

HTTP_PORT = 8000                 # vLLM's, and the port clients' manifests already name
API_KEY_REF = {"secretKeyRef": {"name": "splitserve-api-key", "key": "api-key",
                                "optional": True}}
WORKERS = ("worker", "worker-gpu")


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for key in [k for k in os.environ if k.startswith("SPLITSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_http_front_end_is_a_deployment_behind_a_service(objects: Objects) -> None:
    dep = deployment(objects, "http")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels_match(dep["spec"]["selector"]["matchLabels"], pod_labels)
    assert dep["spec"]["replicas"] >= 2         # scaled apart; a rollout keeps one serving
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    c = container(objects, "http")
    assert c["command"] == ["python", "-m", "http_svc"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": HTTP_PORT}
    svc = objects[("Service", "splitserve-http")]["spec"]
    assert labels_match(svc["selector"], pod_labels)
    (port,) = svc["ports"]
    assert (port["port"], port["targetPort"]) == (HTTP_PORT, "http")
    assert "publishNotReadyAddresses" not in svc        # only pods whose /health says ready
    # Liveness: the process serves HTTP; readiness: a replica can serve.
    assert c["livenessProbe"]["httpGet"] == {"path": "/version", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/version", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # A client of the public API: no cluster token, no model, no internal port.
    env = env_of(c)
    assert "SPLITSERVE_CLUSTER_TOKEN" not in env
    assert all(v["name"] != "models" for v in dep["spec"]["template"]["spec"]["volumes"])


def test_the_http_env_parses_into_the_schedulers_public_service(
        objects: Objects, monkeypatch: pytest.MonkeyPatch) -> None:
    from http_svc.__main__ import parse_config
    from scheduler_svc.__main__ import parse_args as parse_scheduler

    use_env(monkeypatch, resolved_env(container(objects, "scheduler")))
    server = parse_scheduler(container(objects, "scheduler")["command"][3:]).server
    use_env(monkeypatch, resolved_env(container(objects, "http")))
    http = parse_config(container(objects, "http")["command"][3:])
    assert (http.host, http.port) == ("0.0.0.0", HTTP_PORT)
    public = {p["name"]: p for p in objects[("Service", "splitserve")]["spec"]["ports"]}
    assert http.scheduler_address == f"splitserve:{public['grpc']['port']}"
    assert public["grpc"]["port"] == server.port
    # Drained within the pod's grace period.
    grace = deployment(objects, "http")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    assert http.drain_timeout_s < grace


def test_metrics_moved_off_8000(objects: Objects, monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler_svc.__main__ import parse_args as parse_scheduler

    use_env(monkeypatch, resolved_env(container(objects, "scheduler")))
    server = parse_scheduler(container(objects, "scheduler")["command"][3:]).server
    assert server.metrics_port == 50056              # compose.yaml's too
    for name in ("splitserve", "splitserve-control"):
        assert all(p["port"] != HTTP_PORT for p in objects[("Service", name)]["spec"]["ports"])
    assert all(p["containerPort"] != HTTP_PORT for p in container(objects, "scheduler")["ports"])
    metrics = {p["name"]: p for p in objects[("Service", "splitserve")]["spec"]["ports"]}
    assert metrics["metrics"]["port"] == server.metrics_port


def scraped_services(objects: Objects, monitor: Doc) -> list[Doc]:
    selector = monitor["spec"]["selector"]["matchLabels"]
    return [svc for (kind, _), svc in objects.items() if kind == "Service"
            and labels_match(selector, svc["metadata"].get("labels", {}))]


def test_the_service_monitor_scrapes_the_schedulers_metrics(objects: Objects) -> None:
    monitor = objects[("ServiceMonitor", "splitserve")]
    (svc,) = scraped_services(objects, monitor)
    assert svc["metadata"]["name"] == "splitserve"
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
    sched = container(objects, "scheduler")
    (target,) = [p for p in sched["ports"] if p["name"] == port["targetPort"]]
    assert target["containerPort"] == int(env_of(sched)["SPLITSERVE_METRICS_PORT"])
    assert endpoint["path"] == "/metrics" and endpoint["scheme"] == "http"


def exposed_families() -> set[str]:
    """The metric families the scheduler's /metrics serves, from its own exposition."""
    from scheduler_svc.cluster.metrics import ClusterMetrics
    from scheduler_svc.cluster.wire import ClusterStatsReply

    stats = ClusterStatsReply(replicas=[], num_migrations=0, num_parked=0,
                              num_requests_total=0, kv_reachable=True)
    text = ClusterMetrics("m", lambda: stats, None).render().decode()
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


def scaled_objects(objects: Objects) -> list[Doc]:
    return [d for (kind, _), d in objects.items() if kind == "ScaledObject"]


def test_workers_scale_on_requests_waiting(objects: Objects) -> None:
    families = exposed_families()
    monitor = objects[("ServiceMonitor", "splitserve")]
    (scraped,) = scraped_services(objects, monitor)
    targets = set()
    for so in scaled_objects(objects):
        spec = so["spec"]
        ref = spec["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
        component = ref["name"].removeprefix("splitserve-")
        assert component in WORKERS, ref
        targets.add(component)
        deployment(objects, component)                    # the target exists
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        metric = re.fullmatch(r"sum\((\S+?)\{job=\"([^\"]+)\"\}\)", meta["query"])
        assert metric is not None, meta["query"]
        assert metric.group(1) == "vllm:num_requests_waiting" and metric.group(1) in families
        # The job label Prometheus gives the ServiceMonitor's series: the Service's name.
        assert metric.group(2) == scraped["metadata"]["name"]
        assert "jobLabel" not in monitor["spec"]
        assert float(meta["threshold"]) > 0
        assert re.fullmatch(r"https?://[\w.-]+:\d+", meta["serverAddress"])
        # Slow down: a worker scaled away moves its live requests; one at a time.
        down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 300
        assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])
    assert targets == set(WORKERS)


def test_workers_have_disruption_budgets(objects: Objects) -> None:
    budgets = {name: d for (kind, name), d in objects.items() if kind == "PodDisruptionBudget"}
    assert set(budgets) == {f"splitserve-{w}" for w in WORKERS}
    for component in WORKERS:
        spec = budgets[f"splitserve-{component}"]["spec"]
        dep = deployment(objects, component)
        assert spec["selector"] == dep["spec"]["selector"]
        assert spec["maxUnavailable"] == 1 and "minAvailable" not in spec
        # The budget covers these pods and no others.
        for (kind, _), other in objects.items():
            if kind == "Deployment" and other is not dep:
                assert not labels_match(spec["selector"]["matchLabels"],
                                        other["spec"]["template"]["metadata"]["labels"])


def test_api_keys_come_from_an_optional_secret(objects: Objects,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from http_svc.__main__ import parse_config
    from scheduler_svc.__main__ import parse_args as parse_scheduler

    holders = {name for (kind, name), d in objects.items() if kind == "Deployment"
               for c in d["spec"]["template"]["spec"]["containers"]
               if "SPLITSERVE_API_KEY" in env_of(c)}
    # Both public APIs, the same keys (http_svc passes its client's key on to the scheduler).
    assert holders == {"splitserve-http", "splitserve-scheduler"}
    for component in ("http", "scheduler"):
        assert env_of(container(objects, component))["SPLITSERVE_API_KEY"] == API_KEY_REF

    def keys(secrets: dict[tuple[str, str], str]) -> tuple[Any, Any]:
        use_env(monkeypatch, resolved_env(container(objects, "http"), secrets))
        http = parse_config(container(objects, "http")["command"][3:])
        use_env(monkeypatch, resolved_env(container(objects, "scheduler"), secrets))
        server = parse_scheduler(container(objects, "scheduler")["command"][3:]).server
        return http.api_keys, server.api_keys

    assert keys({("splitserve-api-key", "api-key"): "k1,k2"}) == (("k1", "k2"),) * 2
    assert keys({}) == ((), ())                    # no Secret: the pods start, the APIs open
    # No key is committed: no Secret among the manifests, and the README shows how to make one.
    assert not [key for key in objects if key[0] == "Secret"]
    readme = (K8S / "README.md").read_text()
    assert "kubectl create secret generic splitserve-api-key --from-literal=api-key=" in readme


def test_network_policy_opens_the_public_ports(objects: Objects) -> None:
    http = objects[("NetworkPolicy", "splitserve-http-public")]["spec"]
    pod_labels = deployment(objects, "http")["spec"]["template"]["metadata"]["labels"]
    assert labels_match(http["podSelector"]["matchLabels"], pod_labels)
    (rule,) = http["ingress"]
    assert "from" not in rule                                       # any client
    assert [p["port"] for p in rule["ports"]] == [HTTP_PORT]
