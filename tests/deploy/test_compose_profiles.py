"""compose.yaml's profiles (issue 29): the file is valid against the Compose specification's JSON schema
(vendored in deploy/compose/compose-spec.json), and each profile starts what it says: Redis, two gateways
behind the balancer and Prometheus always; the SGLang CUDA worker (gpu), the project's CPU engine (cpu) or
simulated workers (sim), each found by the gateways under one DNS name."""

from __future__ import annotations

import json
import shlex
from typing import Any

import jsonschema
import pytest

from loadgen.sim.__main__ import parse_args
from tests.deploy.test_compose import SECRETS, resolved
from tests.support.paths import REPO

SPEC = json.loads((REPO / "deploy" / "compose" / "compose-spec.json").read_text())
ENV = {"HOME": "/home/op", **SECRETS}
ALWAYS = {"redis", "gateway-1", "gateway-2", "lb", "prometheus", "stub-tokenizer"}


def services(data: dict[str, Any], profile: str | None) -> set[str]:
    """What `docker compose [--profile P] up` starts: services without profiles, and those of ``profile``."""
    return {n for n, s in data["services"].items() if not s.get("profiles") or profile in s["profiles"]}


def test_compose_yaml_is_valid_against_the_compose_specification() -> None:
    data = resolved(ENV)
    jsonschema.Draft7Validator.check_schema(SPEC)
    errors = [e.message for e in jsonschema.Draft7Validator(SPEC).iter_errors(data)]
    assert errors == []
    broken = resolved(ENV)
    broken["services"]["lb"]["restart_policy"] = "always"  # a misspelt key is refused
    assert list(jsonschema.Draft7Validator(SPEC).iter_errors(broken))


@pytest.mark.parametrize(
    ("profile", "workers"),
    [(None, set()), ("gpu", {"worker"}), ("cpu", {"worker-cpu"}), ("sim", {"sim-worker"})],
)
def test_each_profile_starts_its_workers_beside_the_shared_services(
    profile: str | None, workers: set[str]
) -> None:
    data = resolved(ENV)
    assert services(data, profile) == ALWAYS | workers
    for name in services(data, profile):  # nothing waits on a service the profile does not start
        assert set(data["services"][name].get("depends_on", {})) <= services(data, profile), name


def test_the_gpu_worker_spreads_over_the_gpus_given() -> None:
    worker = resolved({**ENV, "RADIXGATE_TP": "4"})["services"]["worker"]
    assert "--tp 4" in " ".join(worker["command"].split())
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]


def test_the_sim_workers_run_the_simulator_with_real_flags() -> None:
    sim = resolved(ENV)["services"]["sim-worker"]
    argv = sim["command"]
    assert argv[:3] == ["python", "-m", "loadgen.sim"]
    args = parse_args(argv[3:])  # exits 2 on a flag the simulator does not have
    assert (args.host, args.port) == ("0.0.0.0", 30000)
    assert sim["deploy"]["replicas"] >= 2


def test_redis_persists_and_the_balancer_and_prometheus_know_both_gateways() -> None:
    data = resolved(ENV)
    command = data["services"]["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in data["services"]["redis"]["volumes"])
    nginx = (REPO / "deploy" / "compose" / "nginx.conf").read_text()
    prometheus = (REPO / "deploy" / "compose" / "prometheus.yml").read_text()
    for gateway in ("gateway-1", "gateway-2"):
        env = data["services"][gateway]["environment"]
        port, operator = env["RADIXGATE_PORT"], env["RADIXGATE_SECURITY__OPERATOR_PORT"]
        # clients through the balancer to the API port; Prometheus to the operator port (/metrics is there)
        assert f"server {gateway}:{port}" in nginx and f"{gateway}:{operator}" in prometheus
        assert f"{gateway}:{operator}" not in nginx and f"{gateway}:{port}" not in prometheus
        # the bad-key throttle counts each client, not the balancer: nginx names the client in that header
        header = env["RADIXGATE_SECURITY__CLIENT_ADDRESS_HEADER"]
        assert f"proxy_set_header {header} $remote_addr;" in nginx
    assert "proxy_buffering off" in nginx  # streams pass through as they are written
    for mount in data["services"]["lb"]["volumes"] + data["services"]["prometheus"]["volumes"]:
        source = mount.split(":")[0]
        if source.startswith("./"):
            assert (REPO / source).exists(), source
    assert shlex.split("--scale sim-worker=3")  # the documented scaling form names the service
    assert "--scale sim-worker=" in (REPO / "compose.yaml").read_text()


def test_no_operator_endpoint_is_published_on_every_interface() -> None:
    """The balancer's :8000 (every interface) reaches only the gateways' API ports, which answer /metrics and
    /admin 404 once the operator port is set; what compose publishes of an operator port, and Redis and
    Prometheus, is bound to 127.0.0.1."""
    data = resolved(ENV)
    for name, service in data["services"].items():
        env = service.get("environment") or {}
        if name.startswith("gateway-"):
            assert env["RADIXGATE_SECURITY__OPERATOR_PORT"] != env["RADIXGATE_PORT"]
        for published in service.get("ports", []):
            if name == "lb":
                assert published == "8000:8000"  # the API, for clients
            else:
                assert str(published).startswith("127.0.0.1:"), (name, published)
