"""deploy/k8s/: the Kubernetes manifests, checked offline (no cluster is needed or contacted).

- Every object validates, strictly (no unknown field), against the Kubernetes JSON schemas of
  the oldest release we claim (1.27: gRPC probes generally available) and of the newest the
  `kubernetes-validate` package ships; the custom resources (ServiceMonitor, ScaledObject)
  against tests/deploy/crd_schemas.py.
- The shape issue 23 asks for: scheduler and kvcache as Deployments with Services, workers a
  Deployment of their own (and a GPU one requesting one NVIDIA GPU per pod), the cluster token
  from a Secret, probes on grpc.health.v1, the model on a volume, the internal plane bound to
  the pod's address and fenced by NetworkPolicy.
- Every container's environment parses with its service's own flags into addresses that meet.

The serving parts (HTTP front end, metrics, autoscaling, disruption budgets, API keys) are in
test_k8s_serving.py, the kustomizations in test_kustomize.py. What this does not cover:
applying them to a cluster (none was run; see the README).
"""

import os
from pathlib import Path

import kubernetes_validate
import pytest

from services.model_config import DEFAULT_MODEL_FILE
from tests.deploy import crd_schemas
from tests.deploy.manifests import (
    K8S,
    POD_IP,
    Objects,
    container,
    deployment,
    documents,
    env_of,
    manifest_files,
    resolved_env,
)

VERSIONS = ("1.27.0", "1.37.0")
TOKEN_SECRET = {"name": "splitserve-cluster-token", "key": "token"}
MEMBERS = ("kvcache", "scheduler", "worker", "worker-gpu")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_object_is_valid_for_kubernetes(path: Path, version: str) -> None:
    for doc in documents(path):
        if crd_schemas.is_custom(doc):
            crd_schemas.validate(doc)
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_refuses_a_wrong_field() -> None:
    """The check really checks: a misspelt probe is refused."""
    doc = documents(K8S / "base" / "worker.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_scheduler_and_kvcache_are_deployments_behind_services(
        objects: Objects) -> None:
    services = {"kvcache": ["splitserve-kvcache"],
                "scheduler": ["splitserve", "splitserve-control"]}
    for component, names in services.items():
        dep = deployment(objects, component)
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        port_names = {p["name"] for p in container(objects, component)["ports"]}
        for name in names:
            svc = objects[("Service", name)]["spec"]
            assert svc["selector"].items() <= labels.items(), name
            assert {p["targetPort"] for p in svc["ports"]} <= port_names, name
    # Workers reach a scheduler that is not ready yet (no replica before they join).
    assert objects[("Service", "splitserve-control")]["spec"]["publishNotReadyAddresses"]
    assert "publishNotReadyAddresses" not in objects[("Service", "splitserve")]["spec"]


def test_workers_are_deployments_of_their_own(objects: Objects) -> None:
    cpu, gpu = deployment(objects, "worker"), deployment(objects, "worker-gpu")
    for dep in (cpu, gpu):
        assert "strategy" not in dep["spec"] or dep["spec"]["strategy"]["type"] != "Recreate"
        assert dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] \
            in ("worker", "worker-gpu")
    assert cpu["spec"]["replicas"] == 2
    gpu_container = container(objects, "worker-gpu")
    assert gpu_container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container(objects, "worker")["resources"]["limits"]
    assert env_of(gpu_container)["SPLITSERVE_DEVICE"] == "cuda"
    assert gpu_container["image"] == "splitserve:gpu"
    # No Service in front of workers: the scheduler reaches each at its advertised address.
    assert not [k for k in objects if k[0] == "Service" and "worker" in k[1]]


def test_every_member_takes_the_token_from_the_secret(
        objects: Objects) -> None:
    for component in MEMBERS:
        token = env_of(container(objects, component))["SPLITSERVE_CLUSTER_TOKEN"]
        assert token == {"secretKeyRef": TOKEN_SECRET}, component
    (job,) = [d for k, d in objects.items() if k[0] == "Job"]
    for c in job["spec"]["template"]["spec"]["containers"]:
        assert "SPLITSERVE_CLUSTER_TOKEN" not in env_of({"env": c.get("env", [])})


def test_probes_ask_grpc_health(objects: Objects) -> None:
    kv = container(objects, "kvcache")
    admin_port = int(env_of(kv)["SPLITSERVE_KV_ADMIN_PORT"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert kv[probe]["grpc"] == {"port": admin_port}, probe
    sched = container(objects, "scheduler")
    port = int(env_of(sched)["SPLITSERVE_PORT"])
    assert sched["livenessProbe"]["grpc"] == {"port": port}                # liveness: ""
    assert sched["startupProbe"]["grpc"] == {"port": port}
    assert sched["readinessProbe"]["grpc"] == {"port": port,
                                               "service": "splitserve.v1.Generation"}
    for component in ("worker", "worker-gpu"):
        c = container(objects, component)
        health_file = env_of(c)["SPLITSERVE_HEALTH_FILE"]
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["exec"]["command"] == [
                "python", "-m", "services.healthcheck", "--file", health_file,
                "--max-age", "15"], (component, probe)


def test_the_model_is_on_a_volume(objects: Objects) -> None:
    claim = objects[("PersistentVolumeClaim", "splitserve-models")]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    job = objects[("Job", "splitserve-model-init")]["spec"]["template"]["spec"]
    (mount,) = job["containers"][0]["volumeMounts"]
    assert mount == {"name": "models", "mountPath": "/models"}       # the writer
    for component in ("scheduler", "worker", "worker-gpu"):
        spec = deployment(objects, component)["spec"]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
        assert volume["persistentVolumeClaim"] == {"claimName": "splitserve-models",
                                                   "readOnly": True}
        c = container(objects, component)
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
        assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
        assert env_of(c)["SPLITSERVE_MODEL"] == f"/models/{DEFAULT_MODEL_FILE}"


def test_the_internal_plane_binds_the_pod_address(objects: Objects) -> None:
    internal = {"kvcache": ["SPLITSERVE_KV_HOST"],
                "scheduler": ["SPLITSERVE_CONTROL_HOST", "SPLITSERVE_ADVERTISE_HOST"],
                "worker": ["SPLITSERVE_WORKER_HOST"], "worker-gpu": ["SPLITSERVE_WORKER_HOST"]}
    for component, keys in internal.items():
        env = env_of(container(objects, component))
        for key in keys:
            assert env[key] in ("$(POD_IP)", {"fieldRef": {"fieldPath": "status.podIP"}}), \
                (component, key)
        if "POD_IP" in env:
            assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            names = [e["name"] for e in container(objects, component)["env"]]
            assert names.index("POD_IP") < min(names.index(k) for k in keys)  # defined first
    # Only the public API listens on every interface of the scheduler's pod.
    assert env_of(container(objects, "scheduler"))["SPLITSERVE_HOST"] == "0.0.0.0"


def test_network_policy_fences_the_internal_plane(objects: Objects) -> None:
    internal = objects[("NetworkPolicy", "splitserve-internal")]["spec"]
    assert internal["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "splitserve"}
    (rule,) = internal["ingress"]
    (peer,) = rule["from"]
    assert set(rule) == {"from"} and set(peer) == {"podSelector"}
    # Members only: the HTTP front end (a client, no token) reaches the public ports alone.
    assert peer["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "splitserve"},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                              "values": list(MEMBERS)}]}
    for component in MEMBERS:
        labels = deployment(objects, component)["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == component
    public = objects[("NetworkPolicy", "splitserve-public")]["spec"]
    assert public["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "scheduler"
    (rule,) = public["ingress"]
    sched = resolved_env(container(objects, "scheduler"))
    assert {p["port"] for p in rule["ports"]} == {int(sched["SPLITSERVE_PORT"]),
                                                  int(sched["SPLITSERVE_METRICS_PORT"])}
    assert "from" not in rule                                   # any client


def test_environments_parse_into_addresses_that_meet(objects: Objects,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcache_svc.__main__ import parse_config
    from scheduler_svc.__main__ import parse_args as parse_scheduler
    from worker_svc.__main__ import parse_args as parse_worker

    def use_env(component: str) -> list[str]:
        for key in [k for k in os.environ if k.startswith("SPLITSERVE_")]:
            monkeypatch.delenv(key)
        for key, value in resolved_env(container(objects, component)).items():
            monkeypatch.setenv(key, value)
        return container(objects, component)["command"][3:]

    kv = parse_config(use_env("kvcache"))
    server = parse_scheduler(use_env("scheduler")).server
    worker = parse_worker(use_env("worker"))
    assert (kv.host, server.control_host, server.advertise_host, worker.host) == (POD_IP,) * 4
    assert worker.advertise_host == POD_IP
    assert server.kvcache_address == f"tcp://splitserve-kvcache:{kv.plan_port}"
    assert worker.scheduler_address == f"splitserve-control:{server.control_port}"
    assert kv.store is not None and worker.kv_store == f"tcp://splitserve-kvcache:{kv.store.port}"
    assert server.model_path == worker.model_path
    ports = {p["name"]: p["containerPort"] for p in container(objects, "scheduler")["ports"]}
    assert ports == {"grpc": server.port, "control": server.control_port,
                     "metrics": server.metrics_port}
    ports = {p["name"]: p["containerPort"] for p in container(objects, "kvcache")["ports"]}
    assert ports == {"plan": kv.plan_port, "admin": kv.admin_port, "events": kv.events_port,
                     "store": kv.store.port}
    assert container(objects, "worker")["ports"] == [{"name": "steps",
                                                      "containerPort": worker.port}]
