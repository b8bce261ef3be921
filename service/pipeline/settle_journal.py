"""Settles a stopping gateway could not land, kept on local disk and replayed at the next start (issue 31).

A served request's settle that Redis did not take before the gateway stopped (Redis down through the whole
shutdown drain, ``redis.settle_drain_s``) was counted lost. With ``redis.settle_journal_dir`` set, the
:class:`service.pipeline.settlement.Settler` writes those settles here instead, and the next gateway process
to start on the same folder replays them: each lands at most once, under its request's ``settled:<id>``
marker (:mod:`service.pipeline.settlement`), so a settle whose first try did land is not charged again
while its marker lives (``redis.settle_marker_ttl_s``; a journal older than that may charge it twice, and a
replay says how old the journal was).

One file per stopping process (``settles-<pid>-<random>.journal``), written whole to a temporary name and
renamed (atomic on POSIX), at most ``max_entries`` settles (the rest are counted lost as before). A
starting process claims each file by renaming it to a name of its own first (only one of several
processes starting together gets it), loads it and deletes it. Records are pickled
:class:`~service.pipeline.settlement.Settlement` values under a format version; a file that does not load
(another version of the gateway, a torn write) is set aside as ``*.unreadable`` and logged, never retried.
"""

from __future__ import annotations

import os
import pickle
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("radixgate.settle")

FORMAT = 1
"""The records' format version: a journal of another is set aside, not replayed."""


class SettleJournal:
    """The settles of this host's gateway processes, in ``directory`` (any picklable values; the settler
    writes :class:`~service.pipeline.settlement.Settlement` ones, without their concurrency slot).

    Args:
        directory: the folder (made when missing).
        max_entries: most settles one stopping process writes.
        pid: this process's id (in the file names).
    """

    def __init__(self, directory: Path, max_entries: int, pid: int | None = None) -> None:
        self.directory = directory
        self.max_entries = max_entries
        self._pid = os.getpid() if pid is None else pid

    def write(self, items: Sequence[Any]) -> int:
        """Write up to ``max_entries`` of ``items`` in one new file; returns how many (0: none given).

        Raises:
            OSError: the folder or the file could not be written (the caller counts them lost).
        """
        kept = list(items[: self.max_entries])
        if not kept:
            return 0
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"settles-{self._pid}-{secrets.token_hex(4)}"
        tmp = self.directory / f"{name}.tmp"
        tmp.write_bytes(pickle.dumps((FORMAT, time.time(), kept), protocol=pickle.HIGHEST_PROTOCOL))
        tmp.rename(self.directory / f"{name}.journal")
        return len(kept)

    def claim(self) -> list[Any]:
        """Take every journal in the folder (renamed first, so another process starting at the same time
        does not take it too), load and delete it; the settles in them, oldest file first."""
        if not self.directory.is_dir():
            return []
        found: list[tuple[float, Any]] = []
        for path in sorted(self.directory.glob("settles-*.journal")):
            mine = path.with_suffix(f".replaying-{self._pid}")
            try:
                path.rename(mine)
            except OSError:  # another process claimed it first
                continue
            try:
                version, written_at, items = pickle.loads(mine.read_bytes())
                if version != FORMAT:
                    raise ValueError(f"format {version}, this gateway reads {FORMAT}")
            except Exception as exc:  # a torn or foreign file: set aside, said once
                mine.rename(path.with_suffix(".unreadable"))
                log.error("settle_journal_unreadable", path=str(path), error=str(exc))
                continue
            mine.unlink()
            log.warning(
                "settle_journal_claimed",
                path=str(path),
                settles=len(items),
                age_s=round(time.time() - written_at, 1),
            )
            found += [(written_at, item) for item in items]
        found.sort(key=lambda pair: pair[0])
        return [item for _, item in found]


__all__ = ["FORMAT", "SettleJournal"]
