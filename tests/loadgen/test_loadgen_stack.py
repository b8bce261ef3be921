"""The local stack (``make demo`` / ``make up``, experiments) leaves nothing running when it is interrupted:
Ctrl-C, SIGTERM or SIGHUP while it waits for readiness or while it serves. The gateway runs in its own
session, so a stack that dies without stopping it would leave it (and the SGLang workers it launched)
running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadgen.priority_overload import main as priority_overload_main
from tests.support.servers import free_port
from tests.support.signals import as_a_foreground_job

CHILD = """
import json, sys
from pathlib import Path
from loadgen.stack import LocalStack, terminate_as_exit
port, run_dir, env = int(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
with terminate_as_exit():
    LocalStack(run_dir, port=port, env=env, launch_workers=False).start()  # never ready: no worker answers
"""


def stop_marked(marker: str) -> None:
    """SIGKILL the process groups whose environment holds ``marker`` (what a failing run left behind)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                os.killpg(os.getpgid(int(proc.name)), signal.SIGKILL)
        except OSError:
            continue


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupted_start_stops_the_gateway(stub_model_dir: Path, tmp_path: Path, sig: int) -> None:
    port = free_port()
    env = {
        "RADIXGATE_UPSTREAM__WORKERS": json.dumps([f"http://127.0.0.1:{free_port()}"]),
        "RADIXGATE_API__TOKENIZER_PATH": str(stub_model_dir),
        "RADIXGATE_ENGINE__SERVED_MODEL_NAME": "stub",
    }
    marker = f"stack-{port}-{os.getpid()}"  # inherited by the stack's processes: finds leftovers
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(port), str(tmp_path), json.dumps(env)],
        env={**os.environ, "RADIXGATE_TEST_MARKER": marker},  # ignored by the settings
        preexec_fn=as_a_foreground_job,
        start_new_session=True,  # its own group, signalled as a terminal signals its foreground job
    )
    healthz = f"http://127.0.0.1:{port}/healthz"
    try:
        deadline = time.monotonic() + 60
        while not answers(healthz):
            assert child.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.2)
        os.killpg(child.pid, sig)
        child.wait(timeout=60)
        assert child.returncode != 0
        deadline = time.monotonic() + 10
        while answers(healthz):
            assert time.monotonic() < deadline, "the gateway kept running after its stack was interrupted"
            time.sleep(0.2)
        redis_log = (tmp_path / "redis.log").read_text()
        assert "ready to exit" in redis_log or "Redis is now ready to exit" in redis_log, redis_log[-500:]
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        stop_marked(marker)


KEPT = """
from loadgen.stack import terminate_as_exit, wait_until_stopped
with terminate_as_exit():
    wait_until_stopped("waiting")
print("stopped", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_kept_stack_stopped_by_a_signal_exits_0(sig: int) -> None:
    """``make up`` keeps the stack until a signal; the signal is how it is stopped, so the script goes on to
    stop the stack and exits 0 (SIGTERM made it exit 143 and ``make`` report an error after a clean stop)."""
    child = subprocess.Popen(
        [sys.executable, "-c", KEPT],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=as_a_foreground_job,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "waiting"
    os.killpg(child.pid, sig)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and out.strip() == "stopped"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--duration-s", "0"], "--duration-s must be above 0"),
        (["--duration-s", "-5"], "--duration-s must be above 0"),
        (["--overload", "nan"], "--overload must be above 0"),
        (["--concurrency", "0"], "--concurrency must be above 0"),
        (["--window-max", "-1"], "--window-max must be 0 or more"),
        (["--json", "/no/such/dir/out.json"], "--json: no folder /no/such/dir"),
    ],
)
def test_priority_overload_refuses_bad_arguments_before_starting_a_stack(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # these started Redis, the gateway and a CPU SGLang worker (a minute) and then failed or ran nothing
    monkeypatch.chdir(tmp_path)  # were a stack started, its .run folder would land here
    with pytest.raises(SystemExit) as exited:
        priority_overload_main(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / ".run").exists()


class FakeStack:
    """Stands in for :class:`loadgen.stack.LocalStack`: records whether it was stopped."""

    stopped = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.url = "http://127.0.0.1:9"

    def __enter__(self) -> FakeStack:
        return self

    def __exit__(self, *exc: object) -> None:
        FakeStack.stopped = True

    def create_tenant(self, tenant_id: str, **kwargs: object) -> str:
        return f"key-{tenant_id}"


def test_priority_overload_ctrl_c_stops_the_stack_and_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C mid-run stopped the stack but ended in a 60-line traceback (KeyboardInterrupt, asyncio.run)."""
    import loadgen.priority_overload as priority_overload

    async def interrupted(*args: object) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(priority_overload, "LocalStack", FakeStack)
    monkeypatch.setattr(priority_overload, "run", interrupted)
    FakeStack.stopped = False
    with pytest.raises(SystemExit) as exited:
        priority_overload_main(["--no-pin"])
    assert exited.value.code == 130
    err = capsys.readouterr().err
    assert FakeStack.stopped and "interrupted" in err and "Traceback" not in err, err
