"""A rolling restart costs the clients nothing (issue 29): over 2 gateway processes (one port,
``RADIXGATE_WORKERS=2``) and 3 simulated workers at 80% of the capacity measured first, every gateway
process is replaced (SIGHUP: uvicorn starts the new one, then drains the old: service/runtime/drain.py)
and every worker is drained, stopped, started again and registered again, one at a time, then the gateway
again. Goal: >= 1,000 streams, 0 client-visible errors, 0 truncated streams, and the quota ledger
balances (what Redis charged = what the clients were served)."""

from __future__ import annotations

from pathlib import Path

from loadgen.rolling_restart import run_rolling_restart


def test_restarting_every_gateway_process_and_worker_under_load_loses_no_stream(
    stub_model_dir: Path, tmp_path: Path
) -> None:
    figures = run_rolling_restart(tmp_path / "run", stub_model_dir, streams=1000, load=0.8)
    assert figures.streams == 1000 and figures.capacity_rps > 0
    assert figures.errors == [], figures.errors[:10]
    assert figures.ok == 1000
    assert figures.gateway_restarts == 4  # 2 processes, replaced twice
    assert figures.worker_restarts == 3
    assert figures.balanced, (figures.charged, figures.served)
    assert figures.charged["requests"] == 1000 and figures.charged["completion_tokens"] == 1000 * 16
