"""Command line: ``python -m service serve`` runs the gateway; ``python -m service worker`` one engine;
``python -m service diagnose`` says where a window's tail latency went."""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
from pathlib import Path
from typing import Any

import orjson
import redis
import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError
from rich.console import Console

from service.app import create_app
from service.config.doc import settings_table
from service.config.settings import Settings
from service.config.sources import (
    CONFIG_FILE_ENV,
    ConfigFileError,
    config_file_in,
    effective_settings,
    non_json_variables,
    origin,
    startup_warnings,
)
from service.diagnose.command import (
    DEFAULT_THRESHOLDS,
    MAX_WINDOW_S,
    DiagnoseInputError,
    Result,
    base_url,
    from_prometheus,
    from_scrapes,
    parse_duration,
    thresholds,
)
from service.diagnose.report import as_json, render
from service.diagnose.sources import SourceError
from service.observability.logs import configure_logging
from service.protocol.fields import parameters_table
from service.protocol.responses import responses_table
from service.runtime.host_serve import MULTIPROC_ENV, serve_one, serve_processes
from service.runtime.http_protocol import KEEP_ALIVE_S
from service.workers.launcher import WorkerProcess, WorkerStartError
from tenancy.migrate_layout import migrate, migration_client
from tenancy.redis_client import cluster_mismatch

cli = typer.Typer(add_completion=False, help="radixgate: multi-tenant gateway for SGLang workers.")
config_cli = typer.Typer(add_completion=False, help="Check the settings.")
cli.add_typer(config_cli, name="config")

CONFIG_OPTION = typer.Option(
    None, "--config", help="TOML or YAML settings file (RADIXGATE_* environment variables override it)."
)


def load_settings(config: Path | None = None) -> Settings:
    """Settings from the environment over the file ``config`` (or RADIXGATE_CONFIG_FILE); exits with a short
    message (no traceback) when they are invalid, and warns of each name that is no setting."""
    file = config_file_in(os.environ, config)
    try:
        settings = Settings(config_file=config) if config else Settings()
    except ConfigFileError as exc:
        typer.echo(f"invalid setting {CONFIG_FILE_ENV}: {exc}", err=True)
        raise typer.Exit(2) from None
    except ValidationError as exc:
        for err in exc.errors():
            msg = str(err["msg"]).removeprefix("Value error, ")
            if err["loc"]:
                where = "RADIXGATE_" + "__".join(str(p).upper() for p in err["loc"])
                where += origin(Settings, err["loc"], os.environ, file)
                typer.echo(f"invalid setting {where}: {msg}", err=True)
            else:  # a rule across settings (e.g. workers and engine.launch)
                typer.echo(f"invalid settings: {msg}", err=True)
        raise typer.Exit(2) from None
    except SettingsError as exc:  # a list or map that is not JSON: pydantic-settings names the top field
        field = re.search(r'field "(\w+)"', str(exc))
        culprits = non_json_variables(Settings, os.environ, field.group(1)) if field else []
        named = f"RADIXGATE_{field.group(1).upper()}" if field else "RADIXGATE_*"
        for where, example in culprits or [(named, "")]:
            shown = f", e.g. {where}={example}" if example else ""
            typer.echo(
                f"invalid setting {where}: not valid JSON ({exc.__cause__}); lists and maps are given as "
                f"JSON{shown}",
                err=True,
            )
        raise typer.Exit(2) from None
    for line in startup_warnings(Settings, os.environ, file):
        typer.echo(line, err=True)
    return settings


def check_tokenizer(settings: Settings) -> None:
    """Exit with a short message when a tokenizer folder the gateway counts prompts with is missing (the
    single model's, or each of ``models``)."""
    if not settings.models:
        if not (settings.tokenizer_path / "tokenizer.json").is_file():
            where = "API__TOKENIZER_PATH" if settings.api.tokenizer_path else "ENGINE__MODEL_PATH"
            typer.echo(
                f"invalid setting RADIXGATE_{where}: no tokenizer.json in {settings.tokenizer_path} (the "
                "gateway counts prompt tokens with the model's tokenizer; `make engine` fetches the default "
                "model)",
                err=True,
            )
            raise typer.Exit(2)
        return
    for i, model in enumerate(settings.model_registry().models):
        if not (model.tokenizer_path / "tokenizer.json").is_file():
            typer.echo(
                f"invalid setting RADIXGATE_MODELS ({i}, '{model.id}'): no tokenizer.json in "
                f"{model.tokenizer_path} (each model's prompts are counted with its own tokenizer)",
                err=True,
            )
            raise typer.Exit(2)


@cli.command()
def serve(config: Path | None = CONFIG_OPTION) -> None:
    """Run the gateway (settings from RADIXGATE_* environment variables); RADIXGATE_WORKERS processes."""
    # serve owns prometheus_client's multiprocess mode: a fresh directory per run, only with several
    # processes; an inherited one could hold another run's files (summed in) or slow one process down
    inherited = [name for name in MULTIPROC_ENV if os.environ.get(name)]
    if inherited:
        typer.echo(
            f"unset {' and '.join(inherited)}: serve creates a fresh metrics directory per run "
            "itself when RADIXGATE_WORKERS > 1 (and none with one process)",
            err=True,
        )
        raise typer.Exit(2)
    settings = load_settings(config)
    check_tokenizer(settings)
    mismatch = cluster_mismatch(settings.redis.url, settings.redis.cluster, settings.redis.connect_timeout_s)
    if mismatch is not None:
        typer.echo(f"invalid setting: {mismatch}", err=True)
        raise typer.Exit(2)
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": "warning",
        "access_log": False,
        "loop": "uvloop",
        "http": "service.runtime.http_protocol:CoalescingHttpToolsProtocol"
        if settings.http_write_coalescing
        else "service.runtime.http_protocol:GatewayHttpToolsProtocol",
        # no X-Forwarded-For rewriting: nothing reads the client address (an ASGI layer less per request)
        "proxy_headers": False,
        "timeout_keep_alive": KEEP_ALIVE_S,
        # uvicorn is told to stop accept_for_s after the signal (service/runtime/drain.py) and waits for
        # the connections to close: the drain's own deadlines bound the requests, the keep-alive timeout
        # the idle connections; bounded all the same
        "timeout_graceful_shutdown": math.ceil(
            settings.shutdown.drain_timeout_s + settings.shutdown.end_timeout_s + KEEP_ALIVE_S + 1
        ),
    }
    sec = settings.security  # the operator endpoints' own port (service/api/operator_access.py)
    if sec.operator_port == settings.port:
        typer.echo("invalid setting RADIXGATE_SECURITY__OPERATOR_PORT: it is RADIXGATE_PORT too", err=True)
        raise typer.Exit(2)
    operator = None if sec.operator_port is None else (sec.operator_host, sec.operator_port)
    if settings.workers == 1:
        raise typer.Exit(serve_one(create_app(settings), options, operator))
    else:  # each process builds its app (and reads the same RADIXGATE_* settings) from the factory
        configure_logging(settings.observability.log_level)
        if config is not None:  # each process reads its settings again, the file too
            os.environ[CONFIG_FILE_ENV] = str(config.resolve())
        serve_processes(settings.workers, options, os.environ, operator)


@cli.command()
def worker(
    port: int = typer.Option(None, min=1, max=65535, help="Port (default: engine.base_port)."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Run one SGLang worker in the foreground, built from RADIXGATE_ENGINE__* settings."""
    settings = load_settings(config)
    configure_logging(settings.observability.log_level)
    proc = WorkerProcess(settings.engine, port or settings.engine.base_port)
    proc.start()
    stop = asyncio.Event()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # Ctrl-C or SIGTERM while the engine still loads (minutes for a large model) stops it at once
        ready = asyncio.create_task(proc.wait_ready())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return
        stopping.cancel()
        ready.result()  # raises WorkerStartError when it exited or never answered
        await stop.wait()

    try:
        asyncio.run(run())
    except WorkerStartError as exc:
        typer.echo(f"the worker did not start: {exc} (its output is above, or in engine.log_dir)", err=True)
        raise typer.Exit(1) from None
    finally:
        proc.stop()


@cli.command("diagnose")
def diagnose_command(
    prometheus: str | None = typer.Option(None, "--prometheus", help="Prometheus base URL (PromQL mode)."),
    window: str = typer.Option("5m", "--window", help="--prometheus: the window, a PromQL duration."),
    baseline: str = typer.Option("1h", "--baseline", help="--prometheus: the span before it, the baseline."),
    at: float | None = typer.Option(None, "--at", help="--prometheus: the window's end, Unix s (now)."),
    gateway: str | None = typer.Option(None, "--gateway", help="Gateway base URL (direct-scrape mode)."),
    worker: list[str] = typer.Option([], "--worker", help="A worker's base URL (repeat; default: all)."),
    window_s: float = typer.Option(10.0, "--window-s", min=1, max=MAX_WINDOW_S, help="Direct: window, s."),
    interval_s: float = typer.Option(1.0, "--interval-s", min=0.1, max=60, help="Direct: scrape period, s."),
    admin_token: str | None = typer.Option(
        None, "--admin-token", help="Direct, no --worker: lists the workers (default: the settings' token)."
    ),
    min_share: float = typer.Option(
        DEFAULT_THRESHOLDS.min_share, "--min-share", min=0, max=1, help="Least share a cause adds."
    ),
    min_excess_ms: float = typer.Option(
        DEFAULT_THRESHOLDS.min_excess_s * 1000, "--min-excess-ms", min=0, max=60000, help="Least it adds, ms."
    ),
    min_slowdown: float = typer.Option(
        DEFAULT_THRESHOLDS.min_slowdown, "--min-slowdown", min=1, max=1000, help="Engine slowdown gate."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the same data as JSON."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Say where the P99 latency of a window went, ranked, with the evidence (docs/observability.md,
    "Diagnose"). Exit 0 with a report (whether or not a cause is named), 1 when a source does not answer,
    2 on bad options."""
    th = thresholds(min_share, min_excess_ms / 1000, min_slowdown)
    try:
        if (prometheus is None) == (gateway is None):
            raise DiagnoseInputError("give either --prometheus URL or --gateway URL")
        if prometheus is not None:
            result: Result = from_prometheus(
                base_url(prometheus, "--prometheus"),
                parse_duration(window, "--window"),
                parse_duration(baseline, "--baseline"),
                at,
                th,
            )
        else:
            assert gateway is not None
            workers = [base_url(w, "--worker") for w in worker]
            token = admin_token
            if not workers and not token:
                token = load_settings(config).admin_token.get_secret_value() or None
            result = asyncio.run(
                from_scrapes(base_url(gateway, "--gateway"), workers, window_s, interval_s, token, th)
            )
    except DiagnoseInputError as exc:
        typer.echo(f"invalid option {exc}", err=True)
        raise typer.Exit(2) from None
    except SourceError as exc:
        typer.echo(f"cannot read the metrics: {exc}", err=True)
        raise typer.Exit(1) from None
    if json_out:
        data = as_json(result.diagnosis, result.source)
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
    else:
        render(result.diagnosis, result.source, Console())


def _print_or_write(tables: dict[str, str], doc: Path | None) -> None:
    """Print ``tables`` (marker -> markdown), or write each between its markers in ``doc``; a file that
    cannot be read or written, or lacks a marker, exits 2 with one line and is left as it was."""
    if doc is None:
        print("\n\n".join(tables.values()))
        return
    try:
        text = doc.read_text()
        for marker, table in tables.items():
            start, end = f"<!-- {marker}:start -->\n", f"\n<!-- {marker}:end -->"
            if start not in text or end not in text:
                raise ValueError(f"no {start.strip()} ... {end.strip()} markers")
            text = text[: text.index(start) + len(start)] + table + text[text.index(end) :]
        doc.write_text(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        typer.echo(f"cannot write the table into {doc}: {reason}", err=True)
        raise typer.Exit(2) from None


_DOC_HELP = "Rewrite the table between the markers of this file (--readme: the old name of this option)."


@config_cli.command("check")
def config_check(config: Path | None = CONFIG_OPTION) -> None:
    """Print every effective setting (secrets masked), tagged [env] or [FILE] where it was set (no tag: the
    default); exit 2 when one is invalid or the tokenizer folder is missing, as `serve` would."""
    settings = load_settings(config)
    check_tokenizer(settings)
    file = config_file_in(os.environ, config)
    for name, value, source in effective_settings(settings, os.environ, file):
        typer.echo(f"{name}={value}" + ("" if source == "default" else f"  [{source}]"))


@cli.command("config-table")
def config_table(
    doc: Path | None = typer.Option(None, "--doc", "--readme", help=_DOC_HELP),
) -> None:
    """Print every setting as a markdown table, or write it into a page between its config-table markers
    (docs/configuration.md: ``python -m service config-table --doc docs/configuration.md``)."""
    _print_or_write({"config-table": settings_table()}, doc)


@cli.command("params-table")
def params_table(
    doc: Path | None = typer.Option(None, "--doc", "--readme", help=_DOC_HELP),
) -> None:
    """Print the OpenAI request parameters (served / accepted / off only / refused) as a markdown table,
    or write it and the ``/v1/responses`` table into a page between their params-table and responses-table
    markers (docs/api.md: ``python -m service params-table --doc docs/api.md``)."""
    tables = {"params-table": parameters_table()}
    _print_or_write(tables | {"responses-table": responses_table()} if doc else tables, doc)


@cli.command("migrate-keys")
def migrate_keys(
    config: Path | None = CONFIG_OPTION,
    source: str | None = typer.Option(
        None, "--from", help="redis:// URL of one Redis holding the old keys (default: the settings' Redis)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would move; write nothing."),
) -> None:
    """Move the keys of the layout before hash tags (rg:tenant:ID and the like) to the current one
    (rg:{ID}:tenant, ...): in place, or from --from into the settings' Redis or Redis Cluster (redis.url,
    redis.cluster, redis.key_prefix). Run it with the gateways stopped; a key whose new name exists is never
    overwritten, so running it again moves nothing. Prints what moved as JSON (docs/redis-cluster.md)."""
    settings = load_settings(config)
    mismatch = cluster_mismatch(settings.redis.url, settings.redis.cluster, settings.redis.connect_timeout_s)
    if mismatch is None and source is not None and cluster_mismatch(source, False, 2.0) is not None:
        mismatch = "--from names a node of a Redis Cluster: it must name one Redis (the old layout's)"
    if mismatch is not None:
        typer.echo(f"invalid setting: {mismatch}", err=True)
        raise typer.Exit(2)
    try:
        target = migration_client(settings.redis.url, settings.redis.cluster)
        origin = target if source is None else migration_client(source, cluster=False)
    except (ValueError, redis.RedisError, redis.exceptions.RedisClusterException) as exc:
        typer.echo(f"cannot connect: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        report = migrate(origin, target, settings.redis.key_prefix, dry_run=dry_run)
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        typer.echo(
            f"the migration stopped: {type(exc).__name__}: {exc} (keys copied before stay copied; a second "
            "run skips them)",
            err=True,
        )
        raise typer.Exit(1) from None
    finally:
        target.close()
        if origin is not target:
            origin.close()
    typer.echo(orjson.dumps({"dry_run": dry_run, **report.as_dict()}, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    cli()
