"""Every metric name the rules of deploy/prometheus/rules/ query exists (issue 28): a running gateway in front
of simulated SGLang workers emits it, or deploy/prometheus/external_series.txt lists it with its source. A
typo or a renamed metric fails here instead of leaving an alert that can never fire. The gateway's own
``/metrics`` also passes ``promtool check metrics``, and docs/observability.md names every family it
declares."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.grafana import panel_series
from tests.support.paths import REPO
from tests.support.prometheus import (
    SimStack,
    exposed_names,
    external_series,
    queried_series,
    selector_names,
    tool,
)


@pytest.fixture(scope="module")
def scraped(redis_url: str, stub_model_dir: Path) -> Iterator[dict[str, str]]:
    """The ``/metrics`` texts of a gateway and its two simulated workers after a few requests (streamed and
    not), keyed ``gateway``, ``worker0``, ``worker1``."""
    with SimStack(redis_url, stub_model_dir) as stack, httpx.Client(base_url=stack.url, timeout=30) as http:
        auth = {"Authorization": f"Bearer {stack.new_key(http)}"}
        for i in range(3):
            for extra in ({}, {"stream": True, "stream_options": {"include_usage": True}}):
                body = stack.chat(f"question {i}", **extra)
                resp = http.post("/v1/chat/completions", json=body, headers=auth)
                assert resp.status_code == 200, resp.text
        texts = {"gateway": http.get("/metrics").text}
        for i, server in enumerate(stack.worker_servers):
            texts[f"worker{i}"] = httpx.get(f"{server.url}/metrics").text
        yield texts


def test_every_queried_series_is_emitted_or_documented(scraped: dict[str, str]) -> None:
    emitted = set().union(*(exposed_names(text) for text in scraped.values()))
    known = emitted | set(external_series())
    used = queried_series()
    assert used, "no rule queries anything"
    missing = {name: sorted(by) for name, by in used.items() if name not in known}
    assert sorted(missing) == [], f"queried by rules, emitted by nothing: {missing}"


def test_the_stack_emits_what_the_rules_rely_on(scraped: dict[str, str]) -> None:
    """The scrape is what it seems: the gateway's and the workers' families are both in it."""
    gateway, worker = exposed_names(scraped["gateway"]), exposed_names(scraped["worker0"])
    assert {"radixgate_worker_healthy", "radixgate_scheduler_outcomes_total"} <= gateway
    assert {"sglang:token_usage", "sglang:num_queue_reqs"} <= worker


def test_external_series_have_a_source_and_are_not_emitted_here(scraped: dict[str, str]) -> None:
    listed = external_series()
    assert listed
    assert all(source for source in listed.values()), "an external series with no source"
    emitted = set().union(*(exposed_names(text) for text in scraped.values()))
    # an entry the stack emits itself belongs to the check above, not to the list
    assert set(listed) & emitted == set()
    # and each is queried by some rule or dashboard panel (the list does not keep names nothing uses)
    assert set(listed) <= set(queried_series()) | set(panel_series())


def test_a_misspelt_name_is_caught() -> None:
    """The check can fail: a rule with a typo queries a name nothing emits."""
    names = selector_names('sum by (band) (rate(radixgate_scheduler_outcome_total{outcome="shed"}[5m])) > 0')
    assert names == {"radixgate_scheduler_outcome_total"}
    assert names - set(queried_series()) == names
    # names given as {__name__="..."} count too; a regex on __name__ is refused (it cannot be checked)
    assert selector_names('{__name__="sglang:token_usage"} > 0.9') == {"sglang:token_usage"}
    with pytest.raises(AssertionError):
        selector_names('{__name__=~"sglang:.*"}')


def test_gateway_metrics_pass_promtool_check_metrics(scraped: dict[str, str]) -> None:
    proc = subprocess.run(
        [tool("promtool"), "check", "metrics"], input=scraped["gateway"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def gateway_families(text: str) -> set[str]:
    """The ``radixgate_*`` metric families a ``/metrics`` text declares, a counter under its ``_total``
    name (the name the docs and the queries use); the ``_created`` samples of unlabelled counters, which the
    parser reads as families of their own, are left out."""
    families = {
        family.name + ("_total" if family.type == "counter" else ""): family.type
        for family in text_string_to_metric_families(text)
        if family.name.startswith("radixgate_")
    }
    created = {name for name in families if name.endswith("_created") and families[name] == "gauge"}
    return set(families) - created


def documented_metrics(page: str) -> tuple[set[str], set[str]]:
    """The metric names a page writes in backticks, without the ``radixgate_`` prefix and labels
    (```requests_total{tenant,model,status}```, ```radixgate_shed_total```), and the prefixes it
    writes with a wildcard (```engine_*{worker,model}```)."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for token in re.findall(r"`([^`\n]+)`", page):
        found = re.fullmatch(r"(?:radixgate_)?([a-z][a-z0-9_]*?)(_\*)?(?:\{[a-z_, =\"]*\})?", token)
        if found:
            (prefixes if found.group(2) else names).add(found.group(1))
    return names, prefixes


def undocumented(families: set[str], page: str) -> list[str]:
    """The families ``page`` does not name (by name or a wildcard prefix)."""
    names, prefixes = documented_metrics(page)
    return sorted(
        name
        for name in families
        if (short := name.removeprefix("radixgate_")) not in names
        and not any(short.startswith(prefix + "_") for prefix in prefixes)
    )


def test_the_observability_page_lists_every_metric_the_gateway_emits(scraped: dict[str, str]) -> None:
    """docs/observability.md's metric list missed radixgate_shed_total and the planner's three gauges."""
    families = gateway_families(scraped["gateway"])
    assert {"radixgate_shed_total", "radixgate_desired_workers", "radixgate_engine_token_usage"} <= families
    page = (REPO / "docs" / "observability.md").read_text()
    assert undocumented(families, page) == []
    # the check can fail: a page without the planner's paragraph misses its gauges
    cut = page.replace("`desired_workers{model}`", "").replace("`planner_reason{model,reason}`", "")
    assert undocumented(families, cut) == ["radixgate_desired_workers", "radixgate_planner_reason"]
