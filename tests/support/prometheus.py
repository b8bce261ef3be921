"""deploy/prometheus/ for the tests (issue 28): the real tools (Debian's ``prometheus`` and
``prometheus-alertmanager`` packages, installed by scripts/setup_gateway.sh), the rule files, and the metric
names their PromQL queries, read with a PromQL parser (``promql-parser``, the Rust parser of GreptimeDB's
promql-parser crate), not with regexes."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadgen.sim.profiles import SimProfile, get_profile
from loadgen.sim.server import SimServer
from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.support.paths import REPO
from tests.support.servers import ThreadedServer

PROM = REPO / "deploy" / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROM / "tests").glob("*.yml"))
EXTERNAL_SERIES = PROM / "external_series.txt"


def tool(name: str) -> str:
    """The path of ``name``; fails (no skip) when the setup did not install it."""
    path = shutil.which(name)
    assert path, f"{name} is not installed: run scripts/setup_gateway.sh (make setup does)"
    return path


def run_tool(*args: str | Path, cwd: Path | None = None) -> str:
    """Run a tool; fails with its output unless it exits 0. Returns stdout and stderr together."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, cwd=cwd)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return output


def rules(paths: list[Path] = RULE_FILES) -> Iterator[dict[str, Any]]:
    """Every rule (recording or alert) of ``paths``, as its YAML mapping."""
    for path in paths:
        for group in yaml.safe_load(path.read_text())["groups"]:
            yield from group["rules"]


def alerts() -> list[dict[str, Any]]:
    """The alert rules of deploy/prometheus/rules/."""
    return [rule for rule in rules() if "alert" in rule]


def selector_names(expr: str) -> set[str]:
    """The metric names the vector and range selectors of ``expr`` select (a bare name or
    ``{__name__="..."}``). Raises ``AssertionError`` on a selector with no exact name: a regex on
    ``__name__`` cannot be checked against the series that exist."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            exact = [m.value for m in node.matchers.matchers if m.name == "__name__"]
            name = node.name or (exact[0] if exact else None)
            ops = [m.op for m in node.matchers.matchers if m.name == "__name__"]
            assert name and all(op == promql_parser.MatchOp.Equal for op in ops), f"no exact name in {expr}"
            names.add(name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def queried_series() -> dict[str, set[str]]:
    """Metric name -> the rules (``record`` or ``alert`` names) whose expression queries it, leaving out the
    names that recording rules of deploy/prometheus/rules/ record themselves."""
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    used: dict[str, set[str]] = {}
    for rule in rules():
        for name in selector_names(rule["expr"]) - recorded:
            used.setdefault(name, set()).add(rule.get("record") or rule["alert"])
    return used


def exposed_names(text: str) -> set[str]:
    """The sample names a Prometheus text exposition declares, by family type: a counter ``x`` gives
    ``x_total`` (and ``x_created``), a histogram ``_bucket``, ``_sum``, ``_count``. A family with labels and
    no child yet still counts: it is declared, and its samples appear with the first observation."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def external_series() -> dict[str, str]:
    """deploy/prometheus/external_series.txt: metric name -> its documented source (``name  source``; ``#``
    starts a comment)."""
    listed: dict[str, str] = {}
    for line in EXTERNAL_SERIES.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, source = line.partition(" ")
            listed[name] = source.strip()
    return listed


def scale_durations(expr: str, factor: float) -> str:
    """``expr`` with every range (``[5m]``) multiplied by ``factor`` (parsed and rewritten through the AST):
    the live test runs the shipped rules at 1 s for 1 min."""

    def rescale(node: Any) -> Any:
        if isinstance(node, promql_parser.MatrixSelector):
            scaled = promql_parser.display_duration(scale(node.range, factor))
            return promql_parser.MatrixSelector.parse(f"{node.vector_selector}[{scaled}]")
        return None

    return str(promql_parser.transform(promql_parser.parse(expr), rescale))


def scale(duration: datetime.timedelta, factor: float) -> datetime.timedelta:
    """``duration`` times ``factor``, rounded to whole milliseconds (Prometheus's resolution), >= 1 ms."""
    return datetime.timedelta(milliseconds=max(1, round(duration.total_seconds() * 1000 * factor)))


def scaled_rule_files(out_dir: Path, factor: float) -> list[Path]:
    """Copies of deploy/prometheus/rules/*.yml under ``out_dir`` with every range, ``for`` and group
    ``interval`` multiplied by ``factor``; their paths."""
    written = []

    def duration(text: str) -> str:
        return str(promql_parser.display_duration(scale(promql_parser.parse_duration(text), factor)))

    edits: dict[str, Callable[[str], str]] = {
        "expr": lambda e: scale_durations(e, factor),
        "for": duration,
    }
    for path in RULE_FILES:
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            if "interval" in group:
                group["interval"] = duration(group["interval"])
            for rule in group["rules"]:
                for key, edit in edits.items():
                    if key in rule:
                        rule[key] = edit(str(rule[key]))
        target = out_dir / path.name
        target.write_text(yaml.safe_dump(doc, sort_keys=False))
        written.append(target)
    return written


class SimStack:
    """A gateway in front of simulated SGLang workers (loadgen.sim), each in a uvicorn thread: what the
    names check scrapes and the live test's Prometheus watches.

    Args:
        redis_url: the session's redis-server.
        model_dir: the stub tokenizer folder.
        workers: how many simulated workers.
        speed: the workers' simulated seconds per wall-clock second (< 1: slower than the modelled H100).
        profile: the workers' step-time profile (loadgen.sim.profiles), or its name.
        sim: further arguments of each SimServer (``dcgm``, ``knobs``...).
        settings: further settings sections of the gateway (merged over the defaults here).
    """

    MODEL = "sim-model"

    def __init__(
        self,
        redis_url: str,
        model_dir: Path,
        workers: int = 2,
        speed: float = 1.0,
        profile: str | SimProfile = "llama-3.1-8b-h100",
        sim: dict[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        steps = get_profile(profile) if isinstance(profile, str) else profile
        self.sims = [
            SimServer(steps, seed=i, model_name=self.MODEL, speed=speed, **(sim or {}))
            for i in range(workers)
        ]
        self.worker_servers = [ThreadedServer(sim.app) for sim in self.sims]
        upstream = {"health_interval_s": 0.2, "max_attempts": 2, **settings.pop("upstream", {})}
        self.settings = {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": f"promstack{next(_stack_ids)}:"},
            "engine": {"served_model_name": self.MODEL},
            "upstream": {**upstream, "workers": [s.url for s in self.worker_servers]},
            "api": {"tokenizer_path": str(model_dir), "context_length": 4096},
            **settings,
        }
        self.gateway: ThreadedServer | None = None
        self._stack = contextlib.ExitStack()

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        assert self.gateway is not None
        return self.gateway.url

    def __enter__(self) -> SimStack:
        with contextlib.ExitStack() as stack:
            for server in self.worker_servers:
                stack.enter_context(server)
            self.gateway = stack.enter_context(
                ThreadedServer(create_app(Settings.model_validate(self.settings)))
            )
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def kill_worker(self, index: int) -> None:
        """Stop simulated worker ``index`` (its port closes: health checks and scrapes fail)."""
        self.worker_servers[index].__exit__(None, None, None)

    def new_key(
        self, http: httpx.Client, priority_class: str = "interactive", quotas: dict[str, float] | None = None
    ) -> str:
        """A new tenant (allowed up to ``priority_class``, with ``quotas``: tenancy.models.Quotas) and an
        API key of it."""
        tenant = f"prom{next(_stack_ids)}"
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        body: dict[str, Any] = {"id": tenant, "name": tenant, "max_priority_class": priority_class}
        if quotas:
            body["quotas"] = quotas
        created = http.post("/admin/tenants", json=body, headers=admin)
        assert created.status_code == 201, created.text
        issued = http.post(f"/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=admin)
        assert issued.status_code == 201, issued.text
        return str(issued.json()["api_key"])

    def chat(self, question: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
        """A chat completion request body for the simulated model."""
        messages = [{"role": "user", "content": question}]
        return {"model": self.MODEL, "messages": messages, "max_tokens": max_tokens, **extra}


_stack_ids = itertools.count()
