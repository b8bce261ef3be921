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


class LocalRedisCluster:
    """``masters`` cluster-enabled redis-servers (no replicas, no persistence but each node's
    ``nodes.conf``) under ``workdir``, made one cluster covering all 16,384 slots.

    :meth:`stop_nodes` kills every node (the cluster is gone for its clients); :meth:`start_nodes` starts
    them again on the same ports, where they find their ``nodes.conf`` and form the same cluster again
    (their data is gone).

    Raises (from :meth:`start`):
        RuntimeError: redis-server or redis-cli is not installed, or the cluster did not form in 30 s.
    """

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise RuntimeError("redis-server/redis-cli are not installed: run scripts/setup_gateway.sh")
        self._server, self._cli, self._workdir = server, cli, workdir
        self.ports = [free_port() for _ in range(masters)]
        self._bus_ports = [free_port() for _ in range(masters)]  # (the default, port + 10000, may pass 65535)
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # node index -> its process

    @property
    def url(self) -> str:
        """The URL of the first node (a client given it finds the others: ``RedisCluster.from_url``)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        """Start the nodes and join them into one cluster; wait until every node says it is ok."""
        self.start_nodes()
        create = [self._cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
        subprocess.run(
            [*create, "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60
        )
        self.wait_formed()

    def start_nodes(self, only: int | None = None) -> None:
        """Start every node's process, or node ``only`` (after :meth:`stop_nodes`: the same ports, the same
        ``nodes.conf``)."""
        for i, (port, bus_port) in enumerate(zip(self.ports, self._bus_ports, strict=True)):
            if only is not None and i != only:
                continue
            node_dir = self._workdir / f"node-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            argv = [
                self._server,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ]
            argv += ["--dir", str(node_dir), "--cluster-enabled", "yes", "--cluster-port", str(bus_port)]
            argv += ["--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"]
            with open(node_dir / "server.log", "ab") as out:
                self._procs[i] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        for i, port in enumerate(self.ports):
            if only is None or i == only:
                _wait_ping(port)

    def stop_nodes(self, only: int | None = None) -> None:
        """Kill every node (SIGKILL), or node ``only``, and wait for them to exit."""
        stopping = [i for i in self._procs if only is None or i == only]
        for i in stopping:
            self._procs[i].kill()
        for i in stopping:
            self._procs.pop(i).wait(timeout=10)

    def close(self) -> None:
        """Stop every node (SIGTERM)."""
        for proc in self._procs.values():
            proc.terminate()
        for proc in self._procs.values():
            proc.wait(timeout=10)
        self._procs = {}

    def wait_formed(self, timeout_s: float = 30.0) -> None:
        """Until each node reports the cluster ok with every slot assigned and knows every node.

        Raises:
            RuntimeError: not within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = []
            for port in self.ports:
                with redis.Redis(port=port, decode_responses=True) as client:
                    info = client.cluster("info")
                    states.append(
                        info["cluster_state"] == "ok"
                        and int(info["cluster_slots_assigned"]) == 16384
                        and int(info["cluster_known_nodes"]) == len(self.ports)
                    )
            if all(states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the Redis Cluster did not form within {timeout_s:.0f} s")


@contextlib.contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[str]:
    """A :class:`LocalRedisCluster` started under ``workdir`` for the block; yields its URL."""
    with local_cluster(workdir, masters) as cluster:
        yield cluster.url


@contextlib.contextmanager
def local_cluster(workdir: Path, masters: int = 3) -> Iterator[LocalRedisCluster]:
    """A :class:`LocalRedisCluster` started under ``workdir`` for the block."""
    cluster = LocalRedisCluster(workdir, masters)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


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
