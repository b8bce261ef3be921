"""deploy/k8s/ (issue 29): every overlay rendered (tests/support/kustomize.py), every object valid against its
own schema (core kinds: kubernetes-validate, strict; KEDA, LeaderWorkerSet and prometheus-operator kinds:
their published CRD schemas, vendored in deploy/k8s/schemas/), and the parts that must agree with the gateway
and with each other: settings names, probes, the drain's timing, discovery, scaling and scraping."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from service.api.health_routes import router
from service.config.settings import Settings
from service.config.sources import unknown_settings
from service.observability.metrics import GatewayMetrics
from service.runtime.drain import SERVED_WHILE_DRAINING
from tests.support.k8s_schemas import CustomResources
from tests.support.kustomize import Unsupported, apply_json6902, build
from tests.support.paths import REPO
from tests.support.prometheus import exposed_names, selector_names

K8S = REPO / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
KUBERNETES_VERSIONS = ("1.30.0", "1.34.0")
"""An older Kubernetes release still under cloud providers' extended support, and a recent one."""
CRS = CustomResources(K8S / "schemas")


def render(overlay: str) -> list[dict[str, Any]]:
    return build(K8S / "overlays" / overlay)


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def pod_templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of a Deployment, StatefulSet or LeaderWorkerSet (leader first)."""
    if workload["kind"] == "LeaderWorkerSet":
        lwt = workload["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return [workload["spec"]["template"]]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def gateway_settings(objects: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The gateway container's Settings, as it starts with the manifest's environment (secrets filled in)."""
    container = one(objects, "Deployment", "radixgate-gateway")["spec"]["template"]["spec"]["containers"][0]
    env = {}
    for var in container["env"]:
        if "valueFrom" in var:
            env[var["name"]] = "secret-from-the-cluster-0123"
        else:
            env[var["name"]] = var["value"]
    gateway_env = {k: v for k, v in env.items() if k.startswith("RADIXGATE_")}
    assert unknown_settings(Settings, gateway_env) == [], "a RADIXGATE_ name that is no setting"
    for name in [n for n in os.environ if n.upper().startswith("RADIXGATE_")]:
        monkeypatch.delenv(name)
    for name, value in gateway_env.items():
        monkeypatch.setenv(name, value)
    return Settings()


def worker_workload(objects: list[dict[str, Any]]) -> dict[str, Any]:
    ref = one(objects, "ScaledObject")["spec"]["scaleTargetRef"]
    workload = one(objects, ref["kind"], ref["name"])
    assert workload["apiVersion"] == ref["apiVersion"]
    return workload


def leader_args(workload: dict[str, Any]) -> list[str]:
    args: list[str] = pod_templates(workload)[0]["spec"]["containers"][0]["args"]
    return args


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_of_every_overlay_is_valid_against_its_schema(overlay: str) -> None:
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "StatefulSet"} <= kinds
    assert {"ScaledObject", "ServiceMonitor", "PodMonitor"} <= kinds
    for obj in objects:
        assert obj["metadata"]["namespace"] == "radixgate"
        if CRS.knows(obj):
            assert CRS.errors(obj) == [], (obj["kind"], obj["metadata"]["name"])
        else:
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)


def test_the_overlays_are_the_documented_three() -> None:
    assert OVERLAYS == ["gpu-multi-node", "gpu-single-node", "sim"]
    assert {worker_workload(render(o))["kind"] for o in OVERLAYS} == {"StatefulSet", "LeaderWorkerSet"}


def test_the_validators_reject_what_the_api_server_would() -> None:
    objects = render("gpu-multi-node")
    scaled = one(objects, "ScaledObject")
    typo = apply_json6902(scaled, [{"op": "add", "path": "/spec/minReplicas", "value": 1}])
    assert any("minReplicas" in e for e in CRS.errors(typo))
    lws = one(objects, "LeaderWorkerSet")
    bad = apply_json6902(lws, [{"op": "replace", "path": "/spec/leaderWorkerTemplate/size", "value": "two"}])
    assert any("size" in e for e in CRS.errors(bad))
    monitor = one(objects, "ServiceMonitor")
    bad = apply_json6902(monitor, [{"op": "remove", "path": "/spec/selector"}])
    assert any("selector" in e for e in CRS.errors(bad))
    deployment = one(objects, "Deployment")
    bad = apply_json6902(deployment, [{"op": "add", "path": "/spec/template/spec/graceSeconds", "value": 3}])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[0], strict=True)


def test_the_renderer_applies_patches_and_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "kustomization.yaml").write_text("resources: [cm.yaml]\nlabels: [{pairs: {a: b}}]\n")
    (base / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {x: '1', y: '2'}\n"
    )
    over = tmp_path / "over"
    over.mkdir()
    (over / "p.yaml").write_text(
        "- {op: replace, path: /data/x, value: '3'}\n- {op: remove, path: /data/y}\n"
        "- {op: add, path: /data/z, value: '4'}\n"
    )
    (over / "kustomization.yaml").write_text(
        "namespace: ns\nresources: [../base]\npatches: [{path: p.yaml, target: {kind: ConfigMap, name: c}}]\n"
    )
    (obj,) = build(over)
    assert obj["data"] == {"x": "3", "z": "4"}
    assert obj["metadata"] == {"name": "c", "namespace": "ns", "labels": {"a": "b"}}
    (over / "kustomization.yaml").write_text(
        "resources: [../base]\npatches: [{path: p.yaml, target: {name: d}}]\n"
    )
    with pytest.raises(ValueError, match="matches no resource"):
        build(over)
    (over / "kustomization.yaml").write_text("resources: [../base]\nnamePrefix: x-\n")
    with pytest.raises(Unsupported, match="namePrefix"):
        build(over)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_sets_real_settings_and_discovers_the_headless_service(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render(overlay)
    settings = gateway_settings(objects, monkeypatch)
    workload = worker_workload(objects)
    headless = [o for o in objects if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None"]
    (service,) = [
        s
        for s in headless
        if selects(s["spec"]["selector"], pod_templates(workload)[0]["metadata"]["labels"])
    ]
    namespace = service["metadata"]["namespace"]
    assert settings.discovery.dns_name == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    assert service["spec"].get("publishNotReadyAddresses", False) is False  # only ready workers are found
    ports = {p["containerPort"] for c in pod_templates(workload)[0]["spec"]["containers"] for p in c["ports"]}
    assert settings.discovery.port in ports
    assert service["spec"]["ports"][0]["targetPort"] == settings.discovery.port
    if workload["kind"] == "StatefulSet":
        assert workload["spec"]["serviceName"] == service["metadata"]["name"]
    else:  # the ranks > 0 of a group serve no HTTP: they are not discovered
        assert not selects(service["spec"]["selector"], pod_templates(workload)[1]["metadata"]["labels"])
    assert settings.redis.url == "redis://radixgate-redis:6379/0"
    assert one(objects, "Service", "radixgate-redis")["spec"]["ports"][0]["port"] == 6379
    args = leader_args(workload)
    model = flag(args, "--served-model-name") if "--served-model-name" in args else flag(args, "--model-name")
    assert settings.engine.served_model_name == model
    assert settings.tokenizer_path is not None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_secrets_and_the_drain_fit_the_grace_period(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render(overlay)
    settings = gateway_settings(objects, monkeypatch)
    pod = one(objects, "Deployment", "radixgate-gateway")["spec"]["template"]["spec"]
    gateway = pod["containers"][0]
    paths = {route.path for route in router.routes}  # type: ignore[attr-defined]
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {"/healthz", "/readyz"} <= paths and {"/healthz", "/readyz"} <= SERVED_WHILE_DRAINING
    port_names = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert port_names[gateway["readinessProbe"]["httpGet"]["port"]] == settings.port
    # Prometheus scrapes the operator port (the API port answers /metrics 404 once it is set)
    service_ports = {
        p["name"]: p["targetPort"] for p in one(objects, "Service", "radixgate-gateway")["spec"]["ports"]
    }
    (scraped,) = {e["port"] for e in one(objects, "ServiceMonitor")["spec"]["endpoints"]}
    assert settings.security.operator_port is not None and settings.security.operator_host == "0.0.0.0"
    assert port_names[service_ports[scraped]] == settings.security.operator_port != settings.port
    secrets = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in gateway["env"] if "valueFrom" in v}
    assert set(secrets) == {"RADIXGATE_ADMIN_TOKEN", "RADIXGATE_KEY_PEPPER"}
    pre_stop = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    shutdown = settings.shutdown
    needed = (
        float(pre_stop[1]) + shutdown.accept_for_s + shutdown.drain_timeout_s + shutdown.end_timeout_s + 1
    )
    assert pod["terminationGracePeriodSeconds"] >= needed
    assert pod["terminationGracePeriodSeconds"] <= needed + 10  # not so long that a hung pod lingers
    comment = (K8S / "base" / "gateway.yaml").read_text()
    assert f"= {needed:g} <= {pod['terminationGracePeriodSeconds']} s" in comment  # the arithmetic shown
    for container in pod["containers"] + pod.get("initContainers", []):
        assert "cpu" in container["resources"]["requests"] and "memory" in container["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_terminating_worker_serves_until_every_gateway_moved_its_streams(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A terminating worker pod leaves the headless Service's records at once; it must keep serving (its
    preStop sleep) through each gateway replica's next lookup and the drain deadline, so that the streams it
    still runs have moved to another worker (docs/scaling.md) before SIGTERM reaches the engine."""
    objects = render(overlay)
    settings = gateway_settings(objects, monkeypatch)
    leader = pod_templates(worker_workload(objects))[0]["spec"]
    pre_stop = leader["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = settings.discovery.interval_s + settings.upstream.worker_drain_deadline_s
    assert float(pre_stop[1]) > needed
    assert leader["terminationGracePeriodSeconds"] > float(pre_stop[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_tier_scales_on_cpu_and_keeps_replicas_through_disruptions(overlay: str) -> None:
    objects = render(overlay)
    deployment = one(objects, "Deployment", "radixgate-gateway")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "radixgate-gateway",
    }
    cpu, in_flight = hpa["spec"]["metrics"]
    assert cpu["resource"]["name"] == "cpu" and cpu["resource"]["target"]["averageUtilization"] <= 80
    assert in_flight["type"] == "Pods"
    name = in_flight["pods"]["metric"]["name"]
    adapter = yaml.safe_load(one(objects, "ConfigMap", "radixgate-prometheus-adapter")["data"]["config.yaml"])
    rule = next(
        r for r in adapter["rules"] if r["name"]["as"] == name
    )  # the adapter serves what the HPA reads
    assert selector_names(rule["seriesQuery"]) == {name}
    registry = CollectorRegistry()
    GatewayMetrics(registry, max_tenant_labels=10)
    assert name in exposed_names(generate_latest(registry).decode())  # a series the gateway emits
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = one(objects, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    service = one(objects, "Service", "radixgate-gateway")
    assert selects(service["spec"]["selector"], labels)
    monitor = one(objects, "ServiceMonitor")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    pods = one(objects, "PodMonitor")
    template = pod_templates(worker_workload(objects))[0]
    assert selects(pods["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
    worker_ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
    assert {e["port"] for e in pods["spec"]["podMetricsEndpoints"]} <= worker_ports
    jobs = {o["metadata"]["labels"][m["spec"]["jobLabel"]] for m, o in ((monitor, service), (pods, template))}
    assert jobs == {"radixgate", "sglang"}  # deploy/prometheus's job names: its rules apply as they are


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_the_workers_on_the_planner_signal(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = render(overlay)
    settings = gateway_settings(objects, monkeypatch)
    scaled = one(objects, "ScaledObject")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"  # replicas = ceil(value / 1): the planner's decision
    query = promql_parser.parse(trigger["metadata"]["query"])
    assert isinstance(query, promql_parser.AggregateExpr) and str(query.op) == "max"  # over the replicas
    selector = query.expr
    assert selector.name == "radixgate_desired_workers"
    matchers = {m.name: m.value for m in selector.matchers.matchers}
    assert matchers == {"model": settings.engine.served_model_name}
    assert scaled["spec"]["minReplicaCount"] >= 1  # the gateway is ready only with a healthy worker
    workload = worker_workload(objects)
    assert "replicas" in workload["spec"]


def test_the_multi_node_workers_run_one_tensor_parallel_group_per_replica() -> None:
    lws = one(render("gpu-multi-node"), "LeaderWorkerSet")
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert size >= 2
    ranks, inits, tps = [], set(), set()
    for template in pod_templates(lws):
        (container,) = template["spec"]["containers"]
        args = container["args"]
        assert flag(args, "--nnodes") == "$(LWS_GROUP_SIZE)"
        ranks.append(flag(args, "--node-rank"))
        inits.add(flag(args, "--dist-init-addr"))
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        tps.add(int(flag(args, "--tp")) // gpus)
        assert int(flag(args, "--tp")) == gpus * size
    assert ranks == ["0", "$(LWS_WORKER_INDEX)"]
    (init,) = inits
    assert re.fullmatch(r"\$\(LWS_LEADER_ADDRESS\):\d+", init)
    leader_ports = {p["containerPort"] for p in pod_templates(lws)[0]["spec"]["containers"][0]["ports"]}
    assert int(init.rsplit(":", 1)[1]) in leader_ports
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_workers_are_pinned_and_gpu_workers_ask_for_their_gpus() -> None:
    pin = re.search(r"^SGLANG_VERSION=(\S+)", (REPO / "scripts/engine/setup.sh").read_text(), re.M)
    assert pin
    for overlay in ("gpu-single-node", "gpu-multi-node"):
        workload = worker_workload(render(overlay))
        for template in pod_templates(workload):
            (container,) = template["spec"]["containers"]
            assert container["image"] == f"lmsysorg/sglang:v{pin.group(1)}"
            gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
            assert int(flag(container["args"], "--tp")) % gpus == 0
            for needed in ("--enable-priority-scheduling", "--enable-metrics"):
                assert needed in container["args"]
