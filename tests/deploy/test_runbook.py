"""docs/runbook.md against the alerts it serves (issue 28): every alert's ``runbook_url`` resolves to a
heading of the runbook (GitHub's anchor rule), every section names an alert that exists, each section says
what the alert means, how to confirm it and what to do, its PromQL parses and queries only series that
exist (the gateway's and the simulated worker's families, the recording rules, the documented external
series), and the gateway and worker routes its commands call are routes of the gateway or of SGLang's API
as the simulated worker serves it."""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, generate_latest
from starlette.routing import BaseRoute, Route

from loadgen.sim.metrics import SimMetrics
from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.api import (
    admin_billing,
    admin_keys,
    admin_planner,
    admin_routes,
    admin_workers,
    health_routes,
    openai_routes,
)
from service.observability.metrics import GatewayMetrics
from tests.support.doc_links import anchors, slug
from tests.support.paths import REPO
from tests.support.prometheus import alerts, exposed_names, external_series, rules, selector_names

RUNBOOK = REPO / "docs" / "runbook.md"
#: level-2 sections that are not an alert's
GENERAL = {"Before you start"}
PARTS = ("**What it means.**", "**How to confirm.**", "**What to do.**")
_FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_GATEWAY_CALL = re.compile(r"\$GW(/[^\s\"'?]*)")
_WORKER_CALL = re.compile(r"\$WORKER(/[^\s\"'?]*)")


def sections(text: str) -> dict[str, str]:
    """Level-2 heading -> the section's text up to the next level-2 heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of ``text`` in ``language`` (``promql``, ``bash``)."""
    return [m.group(2) for m in _FENCED.finditer(text) if m.group(1) == language]


def queries(text: str) -> list[str]:
    """The PromQL queries of ``text``: one a line of its ``promql`` blocks."""
    return [line.strip() for block in blocks(text, "promql") for line in block.splitlines() if line.strip()]


def known_series() -> set[str]:
    """Every series name a query may name: the gateway's families (a fresh registry: declared families
    count), the simulated SGLang worker's, the names the recording rules record, the external list."""
    gateway = GatewayMetrics(CollectorRegistry(), max_tenant_labels=10)
    worker = SimMetrics("m")
    names = exposed_names(generate_latest(gateway.registry).decode())
    names |= exposed_names(generate_latest(worker.registry).decode())
    names |= {rule["record"] for rule in rules() if "record" in rule}
    return names | set(external_series())


def route_patterns(routes: list[BaseRoute]) -> list[re.Pattern[str]]:
    """Each route's path as a regex: ``/admin/workers/{wid}/drain`` matches ``/admin/workers/{id}/drain``
    (a placeholder of the page) and ``/admin/workers/w1/drain``."""
    paths = [str(route.path).rstrip("/") or "/" for route in routes if isinstance(route, Route | APIRoute)]
    return [re.compile("[^/]+".join(map(re.escape, re.split(r"\{[^}]+\}", p))) + "$") for p in paths]


def gateway_routes() -> list[re.Pattern[str]]:
    """The gateway's routes (its routers, with their prefixes)."""
    routers = (
        admin_routes.router,
        admin_keys.router,
        admin_billing.router,
        admin_planner.router,
        admin_workers.router,
        health_routes.router,
        openai_routes.router,
    )
    return route_patterns([route for router in routers for route in router.routes])


def worker_routes() -> list[re.Pattern[str]]:
    """The part of SGLang's HTTP API that the simulated worker serves (what the gateway uses)."""
    return route_patterns(list(SimServer(get_profile("llama-3.1-8b-h100")).app.routes))


def called(text: str, pattern: re.Pattern[str]) -> set[str]:
    """The paths the ``bash`` blocks of ``text`` call through ``$GW`` or ``$WORKER``."""
    return {m.group(1).rstrip("/") for block in blocks(text, "bash") for m in pattern.finditer(block)}


TEXT = RUNBOOK.read_text()
SECTIONS = sections(TEXT)
ALERT_SECTIONS = {name: body for name, body in SECTIONS.items() if name not in GENERAL}


def test_every_runbook_url_resolves_to_a_heading_of_the_runbook() -> None:
    assert alerts()
    headings = anchors(TEXT)
    for rule in alerts():
        path, _, fragment = rule["annotations"]["runbook_url"].partition("#")
        assert (REPO / path).resolve() == RUNBOOK.resolve(), rule["alert"]
        assert fragment in headings, f"{rule['alert']}: no heading #{fragment} in docs/runbook.md"


def test_every_section_names_an_alert_that_exists_in_the_rules_order() -> None:
    names = [rule["alert"] for rule in alerts()]
    assert list(ALERT_SECTIONS) == names
    assert all(slug(name) == name.lower() for name in names)  # the heading gives the runbook_url's anchor


@pytest.mark.parametrize("alert", list(ALERT_SECTIONS))
def test_each_section_says_what_it_means_how_to_confirm_and_what_to_do(alert: str) -> None:
    body = ALERT_SECTIONS[alert]
    positions = [body.find(part) for part in PARTS]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), f"{alert}: {PARTS} in order"
    assert queries(body), f"{alert}: no PromQL to confirm it with"


def test_the_runbooks_promql_parses_and_queries_series_that_exist() -> None:
    known = known_series()
    found = [q for body in ALERT_SECTIONS.values() for q in queries(body)]
    assert len(found) >= 2 * len(ALERT_SECTIONS)
    unknown = {q: sorted(selector_names(q) - known) for q in found if selector_names(q) - known}
    assert unknown == {}
    # each alert's section queries at least one series its rule reads (directly or recorded)
    for rule in alerts():
        confirm = set().union(*(selector_names(q) for q in queries(ALERT_SECTIONS[rule["alert"]])))
        assert confirm & selector_names(rule["expr"]), rule["alert"]


def test_the_check_catches_an_unknown_series_and_a_broken_query() -> None:
    """The checks can fail: a misspelt name is unknown, broken PromQL does not parse."""
    assert selector_names("rate(radixgate_store_unavailable_totl[5m])") - known_series() == {
        "radixgate_store_unavailable_totl"
    }
    with pytest.raises(ValueError):
        selector_names("sum by (band) (rate(radixgate_shed_total[5m])")


def test_the_routes_its_commands_call_exist() -> None:
    gateway, worker = called(TEXT, _GATEWAY_CALL), called(TEXT, _WORKER_CALL)
    assert {"/admin/workers", "/readyz", "/metrics"} <= gateway and {"/health", "/metrics"} <= worker
    gateway_patterns, worker_patterns = gateway_routes(), worker_routes()
    assert [p for p in gateway if not any(r.match(p) for r in gateway_patterns)] == []
    assert [p for p in worker if not any(r.match(p) for r in worker_patterns)] == []
    # and the matching can fail
    assert not any(r.match("/admin/worker") for r in gateway_patterns)


def test_the_readme_and_the_observability_page_link_the_runbook() -> None:
    for page in (REPO / "README.md", REPO / "docs" / "observability.md"):
        assert re.search(r"\]\((docs/)?runbook\.md[#)]", page.read_text()), page.name


def test_sections_split_as_expected() -> None:
    """The section splitter keeps each body with its heading."""
    text = "# T\n\nintro\n\n## A\n\na body\n\n## B\n\nb body\n"
    assert sections(text) == {"A": "\n\na body\n\n", "B": "\n\nb body\n"}
