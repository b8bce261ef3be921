"""Children that take Ctrl-C as they would from a terminal, however the test run was started."""

from __future__ import annotations

import signal


def as_a_foreground_job() -> None:
    """``preexec_fn`` for a child that a test interrupts with SIGINT: SIGINT and SIGQUIT back to their
    defaults.

    A shell without job control starts a background command (``make test &``, ``nohup``, a CI runner's
    detached step) with both ignored (POSIX, "Shell Command Language" 2.11), every process below inherits
    that, and Python then leaves SIGINT ignored instead of raising ``KeyboardInterrupt``: the child a test
    sends Ctrl-C would never see it. A terminal's foreground job has the defaults, and that is what the
    tests mean to reproduce.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
