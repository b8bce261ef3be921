"""SIGINT/SIGTERM during the gateway's start-up: stop waiting, stop what was launched, exit.

uvicorn captures SIGINT and SIGTERM for the whole run (``Server.capture_signals``) but only looks at them
once the app's lifespan start-up has finished; a start-up that waits minutes for a launched SGLang worker
to load its model therefore ignored Ctrl-C and ``docker stop`` until then. :func:`interruptible_startup`
keeps whatever handler is installed (uvicorn's records the signal and exits after start-up as before) and
also cancels the waiting task, which the lifespan turns into :class:`StartupInterrupted`.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StartupInterrupted(RuntimeError):
    """SIGINT or SIGTERM arrived while the gateway was starting (e.g. waiting for a launched worker)."""


@contextmanager
def interruptible_startup() -> Iterator[list[int]]:
    """Within the block, SIGINT/SIGTERM run the handler installed before (uvicorn's, or Python's
    KeyboardInterrupt for SIGINT) and also cancel the current asyncio task. Yields the list of signals
    received, so the caller can tell such a cancellation from another. Handlers are restored on exit. Off
    the main thread (tests serving the app in a thread) signals cannot be handled: nothing changes.

    Raises:
        RuntimeError: called outside a running task.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("interruptible_startup needs a running task")
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {sig: signal.getsignal(sig) for sig in EXIT_SIGNALS}

    def handler(sig: int, frame: FrameType | None) -> None:
        received.append(sig)
        loop.call_soon_threadsafe(task.cancel)
        before = previous[sig]
        if callable(before):
            before(sig, frame)

    for sig in EXIT_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield received
    finally:
        for number, before in previous.items():
            signal.signal(number, before)
