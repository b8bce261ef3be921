"""``python -m service.observability.dashboards [--out DIR] [--check]``: write every dashboard's JSON to
``DIR`` (default ``deploy/grafana``), or with ``--check`` say which files differ from the generator's
output (exit 1) and write nothing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from service.observability.dashboards.catalog import build_all, render


def main(argv: list[str] | None = None) -> int:
    """Write or check the dashboards; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m service.observability.dashboards", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("deploy/grafana"), help="folder of the JSON files")
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing")
    args = parser.parse_args(argv)
    out: Path = args.out
    stale = []
    for name, dashboard in build_all().items():
        path, text = out / name, render(dashboard)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    for path in stale:
        print(f"{path} differs from the generator: run python -m service.observability.dashboards")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
