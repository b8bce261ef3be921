"""Settings that ``config check`` passed and ``serve`` then crashed on at start-up (a traceback, exit
3): a rule between two settings that only a policy's constructor asserted
(``policies.windows.WindowConfig``: ``need 1 <= minimum <= maximum``), a nameserver dnspython cannot take
(it wants an IP address), a discovery name that is no DNS name. The Settings models check them now
(service/config/checks.py ``field_error``, service/config/discovery.py), so both commands refuse them the
same way: exit 2, one line naming the variable, no traceback. Real processes: ``python -m service config
check`` and ``python -m service serve`` with a real Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.config.discovery import DiscoverySettings, dns_name, nameserver_address
from service.config.settings import Settings
from service.runtime.host_serve import MULTIPROC_ENV
from tests.conftest import ADMIN_TOKEN
from tests.support.servers import free_port

BAD = [
    # (the variables, the line both commands print)
    (
        {"RADIXGATE_SCHEDULER__WINDOW_MIN": "2000"},
        "invalid setting RADIXGATE_SCHEDULER__WINDOW_MIN: scheduler.window_min (2000) must be at most "
        "scheduler.window_max (1024)",
    ),
    (
        {"RADIXGATE_SCHEDULER__WINDOW_MIN": "8", "RADIXGATE_SCHEDULER__WINDOW_MAX": "4"},
        "invalid setting RADIXGATE_SCHEDULER__WINDOW_MIN: scheduler.window_min (8) must be at most "
        "scheduler.window_max (4)",
    ),
    (
        {"RADIXGATE_DISCOVERY__DNS_NAME": "workers", "RADIXGATE_DISCOVERY__NAMESERVER": "notahost"},
        "invalid setting RADIXGATE_DISCOVERY__NAMESERVER: a nameserver is an IP address, IPV4:PORT or "
        "[IPV6]:PORT",
    ),
    (
        {"RADIXGATE_DISCOVERY__DNS_NAME": "workers", "RADIXGATE_DISCOVERY__NAMESERVER": "notahost:5353"},
        "invalid setting RADIXGATE_DISCOVERY__NAMESERVER: a nameserver is an IP address",
    ),
    (
        {"RADIXGATE_DISCOVERY__DNS_NAME": "bad name!"},
        "invalid setting RADIXGATE_DISCOVERY__DNS_NAME: not a DNS name, got 'bad name!'",
    ),
    (
        # a model's scheduler override that breaks the rule with the gateway's section under it
        {"RADIXGATE_SCHEDULER__WINDOW_MIN": "16", "RADIXGATE_MODELS": "MODELS:window_max=8"},
        "invalid settings: model 'm', scheduler: window_min scheduler.window_min (16) must be at most "
        "scheduler.window_max (8)",
    ),
]


def run(command: list[str], env: dict[str, str], timeout_s: float = 30) -> tuple[int | str, str]:
    """``python -m service *command`` with ``env``: (exit status, or ``"running"`` when it was still up
    after ``timeout_s`` s and was killed; its stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", *command],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return "running", err
    return proc.returncode, err


@pytest.mark.parametrize(
    ("variables", "says"), BAD, ids=[next(iter(v)) + str(i) for i, (v, _) in enumerate(BAD)]
)
def test_config_check_and_serve_refuse_it_alike(
    variables: dict[str, str], says: str, redis_url: str, stub_model_dir: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in MULTIPROC_ENV and not k.startswith("RADIXGATE_")}
    env |= {
        "RADIXGATE_ADMIN_TOKEN": ADMIN_TOKEN,
        "RADIXGATE_REDIS__URL": redis_url,
        "RADIXGATE_REDIS__KEY_PREFIX": "together:",
        "RADIXGATE_PORT": str(free_port()),
        "RADIXGATE_API__TOKENIZER_PATH": str(stub_model_dir),
        "RADIXGATE_ENGINE__SERVED_MODEL_NAME": "m",
    }
    for name, value in variables.items():
        if value.startswith("MODELS:"):  # a model entry with one scheduler override
            field, _, number = value.removeprefix("MODELS:").partition("=")
            value = json.dumps([{"id": "m", "scheduler": {field: int(number)}}])
        env[name] = value
    check_status, check_err = run(["config", "check"], env)
    serve_status, serve_err = run(["serve"], env, timeout_s=20)
    for status, err in ((check_status, check_err), (serve_status, serve_err)):
        assert status == 2 and "Traceback" not in err, (status, err[-3000:])
        assert err.startswith(says), err[-3000:]
    assert serve_err.splitlines()[0] == check_err.splitlines()[0]


@pytest.mark.parametrize(
    ("values", "loc", "says"),
    [
        (
            {"scheduler": {"window_max": 2, "window_min": 4}},
            ("scheduler", "window_min"),
            "scheduler.window_min (4) must be at most scheduler.window_max (2)",
        ),
        (
            {"replicas": {"heartbeat_s": 20}},
            ("replicas", "heartbeat_s"),
            "replicas.ttl_s (10.0) must be more than replicas.heartbeat_s (20.0)",
        ),
        (
            {"planner": {"min_workers": 9, "max_workers": 8}},
            ("planner", "max_workers"),
            "planner.max_workers (8) must be at least planner.min_workers (9)",
        ),
        (
            {"planner": {"min_workers": 10_000}},
            ("planner", "min_workers"),
            "planner.max_workers",
        ),
        (
            {"engine": {"restart_backoff_base_s": 100}},
            ("engine", "restart_backoff_base_s"),
            "engine.restart_backoff_max_s (60.0) must be at least engine.restart_backoff_base_s (100.0)",
        ),
    ],
)
def test_a_rule_is_shown_at_the_setting_that_was_set(
    values: dict[str, object], loc: tuple[str, str], says: str
) -> None:
    """Either side of a rule may be the one set wrong: the error is located at the one given (the first
    of the two when both were), so the command line names the variable to change."""
    with pytest.raises(ValidationError) as raised:
        Settings.model_validate(values)
    (error,) = raised.value.errors()
    assert error["loc"] == loc and says in error["msg"], error


def test_a_model_override_is_judged_over_the_gateways_section() -> None:
    """A model's ``window_min`` above the scheduler's default maximum is fine when the gateway's maximum is
    higher (the override alone is not judged against the defaults)."""
    settings = Settings.model_validate(
        {
            "engine": {"served_model_name": "m"},
            "scheduler": {"window_max": 4096},
            "models": [{"id": "m", "scheduler": {"window_min": 2000}}],
        }
    )
    (model,) = settings.model_registry().models
    assert (model.scheduler.window_min, model.scheduler.window_max) == (2000, 4096)


@pytest.mark.parametrize(
    ("value", "address"),
    [
        ("127.0.0.1", ("127.0.0.1", 53)),
        ("10.0.0.2:5353", ("10.0.0.2", 5353)),
        ("::1", ("::1", 53)),
        ("[::1]", ("::1", 53)),
        ("[fd00::2]:5353", ("fd00::2", 5353)),
        ("notahost", None),
        ("notahost:53", None),
        ("kube-dns.kube-system:53", None),
        ("10.0.0.2:0", None),
        ("10.0.0.2:65536", None),
        ("10.0.0.2:dns", None),
        ("fd00::2:5353:", None),
        ("", None),
    ],
)
def test_nameserver_forms(value: str, address: tuple[str, int] | None) -> None:
    if address is None:
        with pytest.raises(ValueError, match="a nameserver is an IP address"):
            nameserver_address(value)
        with pytest.raises(ValidationError):
            DiscoverySettings(dns_name="workers", nameserver=value)
    else:
        assert nameserver_address(value) == address
        assert DiscoverySettings(dns_name="workers", nameserver=value).nameserver == value


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("workers", True),
        ("sglang-workers.radixgate.svc.cluster.local", True),
        ("sglang-workers.radixgate.svc.cluster.local.", True),
        ("_sglang._tcp.workers", True),
        ("w1", True),
        ("bad name!", False),
        ("bad name", False),
        ("-workers", False),
        ("workers-", False),
        ("a..b", False),
        (".", False),
        ("a" * 64, False),
        (".".join(["a" * 63] * 4), False),  # 255 characters
        ("http://workers", False),
        ("workers:30000", False),
    ],
)
def test_dns_name_syntax(name: str, ok: bool) -> None:
    if ok:
        assert dns_name(name) == name
        assert DiscoverySettings(dns_name=name).dns_name == name
    else:
        with pytest.raises(ValueError, match="not a DNS name"):
            dns_name(name)


def test_every_forecast_setting_reaches_the_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``RADIXGATE_PLANNER__FORECAST_*`` variable is the value of its field in the pure planner's
    configuration (a setting the docs list and nothing reads is a defect)."""
    values = {
        "MEDIAN_SAMPLES": ("median_samples", 5),
        "OUTLIER_MADS": ("outlier_mads", 0.0),
        "LEVEL_TAU_S": ("level_tau_s", 7.0),
        "TREND_TAU_S": ("trend_tau_s", 90.0),
        "DAMPING": ("damping", 0.9),
        "TREND_Z": ("trend_z", 3.5),
        "TREND_WINDOW_SAMPLES": ("trend_window_samples", 12),
    }
    for name, (_, value) in values.items():
        monkeypatch.setenv(f"RADIXGATE_PLANNER__FORECAST_{name}", str(value))
    forecast = Settings().planner.config().forecast
    assert {field: getattr(forecast, field) for field, _ in values.values()} == dict(values.values())
    fields = {f.removeprefix("forecast_") for f in type(Settings().planner).model_fields if "forecast" in f}
    assert fields == {field for field, _ in values.values()}  # every forecast setting is in the table
