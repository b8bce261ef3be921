"""Every metric name a dashboard of deploy/grafana/ queries exists (issue 28): a running gateway in front of
simulated SGLang workers emits it, a recording rule of deploy/prometheus/rules/ records it, or
deploy/prometheus/external_series.txt lists it with its source (SGLang series the simulation lacks, DCGM).
Panels' queries and the variables' ``label_values`` selectors both count; a typo or a renamed metric
fails here instead of leaving a panel that is always empty."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.grafana import committed, panel_series, recorded_names
from tests.support.prometheus import SimStack, exposed_names, external_series


@pytest.fixture(scope="module")
def emitted(redis_url: str, stub_model_dir: Path) -> Iterator[set[str]]:
    """The sample names a gateway and its two simulated workers expose after a streamed and a
    non-streamed request."""
    with SimStack(redis_url, stub_model_dir) as stack, httpx.Client(base_url=stack.url, timeout=30) as http:
        auth = {"Authorization": f"Bearer {stack.new_key(http)}"}
        for extra in ({}, {"stream": True, "stream_options": {"include_usage": True}}):
            resp = http.post("/v1/chat/completions", json=stack.chat("question", **extra), headers=auth)
            assert resp.status_code == 200, resp.text
        texts = [http.get("/metrics").text]
        texts += [httpx.get(f"{server.url}/metrics").text for server in stack.worker_servers]
        yield set().union(*(exposed_names(text) for text in texts))


def test_every_panel_series_is_emitted_recorded_or_documented(emitted: set[str]) -> None:
    used = panel_series()
    assert len(used) > 40
    known = emitted | recorded_names() | set(external_series())
    missing = {name: sorted(by) for name, by in used.items() if name not in known}
    assert missing == {}, f"queried by panels, emitted by nothing: {missing}"
    # the dashboards read both sides: the gateway's own series and the engines'
    assert {n for n in used if n.startswith("radixgate_")} and {n for n in used if n.startswith("sglang:")}


def test_the_dashboards_use_the_dcgm_series_the_issue_names() -> None:
    named = {
        "DCGM_FI_PROF_SM_ACTIVE",
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        "DCGM_FI_DEV_FB_USED",
    }
    assert named <= set(panel_series())
    assert named <= set(external_series())


def test_a_misspelt_panel_name_is_caught() -> None:
    """The check can fail: a panel with a typo selects a name that nothing emits or records."""
    boards = copy.deepcopy(committed())
    board = boards["radixgate-workers.json"]
    target = next(p for p in board["panels"] if p["type"] != "row")["targets"][0]
    target["expr"] = 'worker:radixgate_worker_health:min{worker=~"$worker"}'
    used = panel_series(boards)
    assert "radixgate-workers: In rotation" in used["worker:radixgate_worker_health:min"]
    assert "worker:radixgate_worker_health:min" not in recorded_names() | set(external_series())
    # a variable's selector is checked too
    board["templating"]["list"][1]["query"] = "label_values(radixgate_worker_healty, worker)"
    assert "radixgate-workers: $worker" in panel_series(boards)["radixgate_worker_healty"]
