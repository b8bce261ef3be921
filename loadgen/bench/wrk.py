"""Drive a target with wrk (Debian's ``wrk`` 4.x): a Lua script for the POST body and headers, and a
``done`` hook that prints the summary and latency percentiles as one JSON line.

wrk is closed-loop: each of ``-c`` connections sends its next request when the previous answer is
complete, so ``-c1`` measures unloaded latency and ``-c64`` saturates a one-core target. Latency is from
writing the request to the end of the whole answer (all chunks of a stream), in microseconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MARKER = "RGBENCH "

_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%s{"requests":%d,"duration_us":%d,"bytes":%d,"errors":{"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d},"latency_us":{"min":%d,"max":%d,"mean":%.1f,"p50":%d,"p90":%d,' ..
    '"p99":%d,"p999":%d}}\\n',
    "MARKER", summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency.min, latency.max, latency.mean, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9)))
end
""".replace("MARKER", MARKER)


class WrkError(RuntimeError):
    """wrk is missing, failed, or printed no summary."""


def _lua_string(text: str) -> str:
    """A double-quoted Lua string literal of ``text`` (bytes above 127 and controls as ``\\ddd``)."""
    out = []
    for byte in text.encode():
        ch = chr(byte)
        if ch in '\\"':
            out.append("\\" + ch)
        elif 32 <= byte < 127:
            out.append(ch)
        else:
            out.append(f"\\{byte:03d}")
    return '"' + "".join(out) + '"'


def lua_script(body: str, headers: Mapping[str, str]) -> str:
    """A wrk script that POSTs ``body`` with ``headers`` on every request and reports as JSON."""
    lines = ['wrk.method = "POST"', f"wrk.body = {_lua_string(body)}"]
    for name, value in headers.items():
        lines.append(f"wrk.headers[{_lua_string(name)}] = {_lua_string(value)}")
    return "\n".join(lines) + "\n" + _DONE


@dataclass(frozen=True, slots=True)
class WrkResult:
    """wrk's summary of one run.

    Attributes:
        requests: completed requests (answers with an error status included).
        duration_s: run time, s.
        errors: failures by kind (``connect, read, write, status`` (non-2xx/3xx), ``timeout``).
        latency_ms: ``min, max, mean, p50, p90, p99, p999``, ms.
    """

    requests: int
    duration_s: float
    errors: dict[str, int]
    latency_ms: dict[str, float]

    @property
    def error_count(self) -> int:
        """All failed requests."""
        return sum(self.errors.values())


def parse_wrk_output(stdout: str) -> WrkResult:
    """Read the JSON line the script's ``done`` hook printed.

    Raises:
        WrkError: no such line.
    """
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            data = json.loads(line[len(MARKER) :])
            return WrkResult(
                requests=int(data["requests"]),
                duration_s=data["duration_us"] / 1e6,
                errors={k: int(v) for k, v in data["errors"].items()},
                latency_ms={k: v / 1000.0 for k, v in data["latency_us"].items()},
            )
    raise WrkError(f"wrk printed no summary: {stdout[-500:]!r}")


def wrk_binary() -> str | None:
    """Path of ``wrk``, or None when it is not installed."""
    return shutil.which("wrk")


class WrkRun:
    """A wrk process (one thread) running in the background against ``url`` for ``duration_s`` whole
    seconds, pinned to ``cpus``; :meth:`result` waits for it.

    Raises:
        WrkError: wrk is not installed.
    """

    def __init__(
        self,
        url: str,
        script: Path,
        connections: int,
        duration_s: int,
        cpus: frozenset[int] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        binary = wrk_binary()
        if binary is None:
            raise WrkError("wrk is not installed: run scripts/peers/setup.sh (or apt-get install wrk)")
        self.duration_s = max(1, int(duration_s))
        self.timeout_s = timeout_s
        argv = [binary, "-t1", f"-c{connections}", f"-d{self.duration_s}s", f"--timeout={int(timeout_s)}s"]
        argv += ["-s", str(script), url]

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        self._proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pin
        )

    def stop(self) -> None:
        """Kill wrk if it still runs (the run was interrupted); nothing once :meth:`result` returned."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()

    def result(self) -> WrkResult:
        """Wait for wrk and return its summary.

        Raises:
            WrkError: wrk exited non-zero, hung, or printed no summary.
        """
        try:
            stdout, stderr = self._proc.communicate(timeout=self.duration_s + self.timeout_s + 30)
        except subprocess.TimeoutExpired as err:
            self._proc.kill()
            self._proc.communicate()
            raise WrkError("wrk did not finish") from err
        if self._proc.returncode != 0:
            raise WrkError(f"wrk exited {self._proc.returncode}: {stderr[-500:] or stdout[-500:]}")
        try:
            return parse_wrk_output(stdout)
        except WrkError as err:
            raise WrkError(f"{err}; stderr: {stderr[-500:]!r}") from err


def run_wrk(
    url: str,
    script: Path,
    connections: int,
    duration_s: int,
    cpus: frozenset[int] | None = None,
    timeout_s: float = 30.0,
) -> WrkResult:
    """Run wrk to the end (see :class:`WrkRun`); an interruption kills it."""
    run = WrkRun(url, script, connections, duration_s, cpus, timeout_s)
    try:
        return run.result()
    finally:
        run.stop()
