"""The Kubernetes manifests (deploy/k8s): every overlay renders, every standard object passes the
Kubernetes schemas offline, the ScaledObject uses only KEDA's documented fields, and the containers'
arguments are ones the worker and `producer serve` accept, agreeing with the probes, ports and grace."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

from producer.api.serve import build_parser as serve_parser
from tests.deploy.conftest import OVERLAYS, container, find, flag, render
from worker.cli import _settings
from worker.cli import build_parser as worker_parser
from worker.config import WorkerConfig, load_config

# The oldest Kubernetes still commonly run, and the newest the package knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
STANDARD_GROUPS = ("v1", "apps/v1", "policy/v1")
# KEDA's ScaledObject (keda.sh/v1alpha1), from its documented specification (keda.sh/docs/2.15
# reference/scaledobject-spec and scalers/prometheus): anything else is a typo KEDA would ignore or refuse.
KEDA_SPEC = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod", "idleReplicaCount",
             "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}  # fmt: skip
KEDA_TARGET = {"apiVersion", "kind", "name", "envSourceContainerName"}
KEDA_FALLBACK = {"failureThreshold", "replicas"}
KEDA_ADVANCED = {"restoreToOriginalReplicaCount", "horizontalPodAutoscalerConfig", "scalingModifiers"}
KEDA_HPA_CONFIG = {"name", "behavior"}
KEDA_TRIGGER = {"type", "metadata", "name", "useCachedMetrics", "authenticationRef", "metricType"}
KEDA_PROMETHEUS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold", "namespace",
                   "customHeaders", "ignoreNullValues", "unsafeSsl", "authModes"}  # fmt: skip
# KEDA reads every trigger metadata value as a string.
KEDA_NUMBERS = ("threshold", "activationThreshold")


def worker_settings(objs: list[dict[str, Any]]) -> WorkerConfig:
    """The worker container's settings, read by the worker's own parser and config (a bad flag fails)."""
    args = container(find(objs, "Deployment", "batchq-worker"))["args"]
    assert args[0] == "worker"
    return load_config(None, _settings(worker_parser().parse_args(args[1:])))


def scaled_object(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objs, "ScaledObject", "batchq-worker")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_the_worker_its_autoscaler_and_producer_serve(overlay: str) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render(overlay)}
    assert {("Deployment", "batchq-worker"), ("PodDisruptionBudget", "batchq-worker"),
            ("ScaledObject", "batchq-worker"), ("Deployment", "batchq-producer"),
            ("Service", "batchq-producer")} <= kinds  # fmt: skip
    # The CPU overlay brings its own Redis; the GPU ones connect to an external one (a Secret made by hand).
    in_cluster = {("StatefulSet", "batchq-redis"), ("Service", "batchq-redis"), ("Secret", "batchq-redis")}
    assert (in_cluster <= kinds) == (overlay == "cpu") and (kinds & in_cluster == set()) == (overlay != "cpu")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_standard_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    standard = [o for o in render(overlay) if o["apiVersion"] in STANDARD_GROUPS]
    assert len(standard) >= 4
    for version in K8S_VERSIONS:
        for obj in standard:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = "/".join(str(p) for p in e.path)
                pytest.fail(f"{overlay}: {obj['kind']} {obj['metadata']['name']} at {where}: {e.message}")


def test_kubernetes_validate_refuses_an_unknown_field() -> None:
    """The check above has teeth: strict validation names a misspelt field."""
    worker = find(render("gpu"), "Deployment", "batchq-worker")
    container(worker)["livenesProbe"] = {"httpGet": {"path": "/health", "port": 9400}}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(worker, K8S_VERSIONS[-1], strict=True)


def _unknown(fields: dict[str, Any], known: set[str], where: str) -> list[str]:
    return [f"{where}.{k}" for k in fields if k not in known]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_scaled_object_uses_only_kedas_documented_fields(overlay: str) -> None:
    so = scaled_object(render(overlay))
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    advanced = spec["advanced"]
    unknown = (_unknown(spec, KEDA_SPEC, "spec") + _unknown(spec["scaleTargetRef"], KEDA_TARGET, "scaleTargetRef")
               + _unknown(spec["fallback"], KEDA_FALLBACK, "fallback")
               + _unknown(advanced, KEDA_ADVANCED, "advanced")
               + _unknown(advanced["horizontalPodAutoscalerConfig"], KEDA_HPA_CONFIG, "horizontalPodAutoscalerConfig"))  # fmt: skip
    for t in spec["triggers"]:
        unknown += _unknown(t, KEDA_TRIGGER, "trigger")
        unknown += _unknown(t["metadata"], KEDA_PROMETHEUS, "prometheus")
        assert all(isinstance(v, str) for v in t["metadata"].values()), t["metadata"]
        assert all(float(t["metadata"][k]) >= 0 for k in KEDA_NUMBERS)
    assert unknown == []
    # KEDA passes `behavior` to the HPA as it is: the HPA's own schema judges it.
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "batchq-worker"},
                    "maxReplicas": spec["maxReplicaCount"],
                    "behavior": advanced["horizontalPodAutoscalerConfig"]["behavior"]}}  # fmt: skip
    kubernetes_validate.validate(hpa, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_scale_from_zero_on_their_queues_pending_work_and_back(overlay: str) -> None:
    objs = render(overlay)
    spec = scaled_object(objs)["spec"]
    assert spec["scaleTargetRef"]["name"] == "batchq-worker"
    # Zero when idle. KEDA refuses idleReplicaCount >= minReplicaCount (an idle count of 0 beside a
    # minimum of 0 included), so the idle count is 0 and the active minimum 1.
    assert spec["idleReplicaCount"] == 0 < spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["cooldownPeriod"] > 0 and spec["fallback"]["replicas"] >= 1
    (trigger,) = spec["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "prometheus" and trigger.get("metricType", "AverageValue") == "AverageValue"
    # The worker's own queue, as producer serve labels it; max over the server's replicas, never a sum.
    queue = worker_settings(objs).queue
    assert meta["query"] == f'max(batchq_queue_pending{{queue="{queue}"}})'
    assert meta["ignoreNullValues"] == "false"  # a lost series falls back, it does not read as zero
    # producer serve always reports that queue, so the series exists before the first batch.
    serve = serve_parser().parse_args(container(find(objs, "Deployment", "batchq-producer"))["args"][2:])
    assert queue in (serve.queue, *serve.metrics_queue)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_drains_within_the_pods_grace_and_is_probed_on_its_health_port(overlay: str) -> None:
    objs = render(overlay)
    worker = find(objs, "Deployment", "batchq-worker")
    pod = worker["spec"]["template"]
    c = container(worker)
    cfg = worker_settings(objs)
    # The kubelet's SIGKILL comes terminationGracePeriodSeconds after SIGTERM: the drain (in-flight work,
    # then the hand-back and the last writes) must end first.
    assert pod["spec"]["terminationGracePeriodSeconds"] >= cfg.shutdown_grace_s + 30
    assert worker["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "100%", "maxUnavailable": 0}
    assert "replicas" not in worker["spec"]  # KEDA's to set
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    assert cfg.metrics_port == port and pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics"}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # a model's download and load
    pdb = find(objs, "PodDisruptionBudget", "batchq-worker")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env["REDIS_URL"] == {"name": "batchq-redis", "key": "REDIS_URL"}


@pytest.mark.parametrize(("overlay", "gpus"), [("cpu", 0), ("gpu", 1), ("gpu-tp", 4)])
def test_gpu_workers_ask_for_as_many_gpus_as_they_have_ranks(overlay: str, gpus: int) -> None:
    objs = render(overlay)
    worker = find(objs, "Deployment", "batchq-worker")
    c = container(worker)
    cfg = worker_settings(objs)
    assert int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0)) == gpus
    assert cfg.engine.device == ("cpu" if gpus == 0 else "cuda")
    if gpus:
        assert cfg.engine.tensor_parallel_size == gpus
    volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes[mounts["/cache"]] or "persistentVolumeClaim" in volumes[mounts["/cache"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_producer_serve_listens_where_its_service_probes_and_scrape_point(overlay: str) -> None:
    objs = render(overlay)
    producer = find(objs, "Deployment", "batchq-producer")
    c = container(producer)
    assert c["args"][:2] == ["producer", "serve"]
    args = serve_parser().parse_args(c["args"][2:])  # a bad flag exits here
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert args.port == port and args.host == "0.0.0.0"
    assert producer["spec"]["template"]["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics",
    }  # fmt: skip
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    service = find(objs, "Service", "batchq-producer")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["spec"]["selector"].items() <= producer["spec"]["template"]["metadata"]["labels"].items()
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"]}
    assert keys == {"REDIS_URL": "batchq-redis", "BATCHQ_API_KEYS": "batchq-api-keys"}


def test_the_in_cluster_redis_keeps_its_data_and_the_secret_points_at_it() -> None:
    objs = render("cpu")
    redis = find(objs, "StatefulSet", "batchq-redis")
    args = container(redis)["args"]
    assert flag(args, "--appendonly") == "yes" and flag(args, "--maxmemory-policy") == "noeviction"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    data = {"name": claim["metadata"]["name"], "mountPath": flag(args, "--dir")}
    assert data in container(redis)["volumeMounts"]
    url = find(objs, "Secret", "batchq-redis")["stringData"]["REDIS_URL"]
    host = re.fullmatch(r"redis://([a-z0-9-]+):6379/0", url)
    assert host is not None and find(objs, "Service", host.group(1))["spec"]["ports"][0]["port"] == 6379
