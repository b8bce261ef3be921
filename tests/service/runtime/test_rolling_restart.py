"""A rolling restart costs the clients nothing (issue 29): over 2 gateway processes (one port,
``RADIXGATE_WORKERS=2``) and 3 simulated workers at 80% of the capacity measured first, every gateway
process is replaced (SIGHUP: uvicorn starts the new one, then drains the old: service/runtime/drain.py)
and every worker is drained, stopped, started again and made active again, one at a time, then the gateway
again. Each worker's drain moves the streams it still runs at its drain deadline (0.05 s: shorter than a
stream) to another worker mid-stream (service/workers/drain_deadline.py). Goal: >= 1,000 streams, 0
client-visible errors, 0 truncated streams, and the quota ledger balances (what Redis charged = what the
clients were served)."""

from __future__ import annotations

from pathlib import Path

from loadgen.rolling_restart import KEEPALIVE_EXPIRY_S, run_rolling_restart
from service.runtime.http_protocol import KEEP_ALIVE_S


def test_restarting_every_gateway_process_and_worker_under_load_loses_no_stream(
    stub_model_dir: Path, tmp_path: Path
) -> None:
    figures = run_rolling_restart(tmp_path / "run", stub_model_dir, streams=1000, load=0.8)
    assert figures.streams == 1000 and figures.capacity_rps > 0
    assert figures.errors == [], figures.errors[:10]
    assert figures.ok == 1000
    assert figures.gateway_restarts == 4  # 2 processes, replaced twice
    assert figures.worker_restarts == 3
    assert figures.moved > 0  # streams resumed on another worker at a drain deadline, and finished whole
    assert figures.balanced, (figures.charged, figures.served)
    assert figures.charged["requests"] == 1000 and figures.charged["completion_tokens"] == 1000 * 16


def test_the_load_clients_expire_idle_connections_before_the_gateway_closes_them() -> None:
    """httpx's default (5 s) equals the gateway's keep-alive timeout: a request sent on a connection the
    gateway closed in the same instant failed with ReadError (1 stream in 1,000, in about 1 run in 4)."""
    assert KEEPALIVE_EXPIRY_S < KEEP_ALIVE_S
