"""A real Redis Cluster for tests: several ``redis-server --cluster-enabled yes`` processes on loopback ports,
joined by ``redis-cli --cluster create`` (Debian's redis-server and redis-tools, as scripts/setup_gateway.sh
installs them)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from tests.support.servers import free_port


@contextlib.contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[str]:
    """Start ``masters`` cluster-enabled redis-servers (no replicas, no persistence) under ``workdir``, make
    them one cluster covering all 16,384 slots, wait until every node says ``cluster_state:ok``, and yield
    the URL of the first node (a client given it finds the others: ``RedisCluster.from_url``).

    Raises:
        RuntimeError: redis-server or redis-cli is not installed, or the cluster did not form in 30 s.
    """
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise RuntimeError("redis-server/redis-cli are not installed: run scripts/setup_gateway.sh")
    ports = [free_port() for _ in range(masters)]
    bus_ports = [free_port() for _ in range(masters)]  # (the default, port + 10000, may pass 65535)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port, bus_port in zip(ports, bus_ports, strict=True):
            node_dir = workdir / f"node-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            argv = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            argv += ["--dir", str(node_dir), "--cluster-enabled", "yes", "--cluster-port", str(bus_port)]
            argv += ["--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"]
            with open(node_dir / "server.log", "wb") as out:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        for port in ports:
            _wait_ping(port)
        create = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
        subprocess.run(
            [*create, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _wait_formed(ports)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def _wait_ping(port: int) -> None:
    client = redis.Redis(port=port, socket_connect_timeout=0.5, retry_on_error=[], retry=None)
    try:
        for _ in range(200):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not answer")
    finally:
        client.close()


def _wait_formed(ports: list[int]) -> None:
    """Until each node reports the cluster ok with every slot assigned and knows every node."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for port in ports:
            with redis.Redis(port=port, decode_responses=True) as client:
                info = client.cluster("info")
                states.append(
                    info["cluster_state"] == "ok"
                    and int(info["cluster_slots_assigned"]) == 16384
                    and int(info["cluster_known_nodes"]) == len(ports)
                )
        if all(states):
            return
        time.sleep(0.1)
    raise RuntimeError("the Redis Cluster did not form within 30 s")
