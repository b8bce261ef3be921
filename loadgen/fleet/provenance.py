"""The code the fleet experiments ran: one SHA-256 over what decides their figures.

``docs/experiments.md`` records it in each section the fleet experiments write
(``python -m loadgen.fleet.experiments NAME --write-doc``), and ``tests/loadgen/test_experiments_doc.py``
fails when
the code has changed since: the figures are deterministic for the code and the seeds, so a section whose
recorded hash is not the code's hash shows numbers that the code no longer gives.

What is hashed (:func:`code_hash`):

- the code of every ``.py`` file under :data:`SOURCE_DIRS` (the fleet simulation and its experiments, the
  simulated SGLang workers and their profiles) and of every project module they import, directly or not
  (read from the files' ``import`` statements: the admission core and the other pure policies the
  simulated gateway runs, the scenario planner, the report, the tenants' quotas), apart from
  :data:`NOT_INPUTS`; a test checks it against the import graph (grimp). A project module the
  experiments do not import is not hashed;
- :func:`defaults_json`: the JSON of the defaults the experiments start from, ``CoreConfig()`` (which the
  gateway's Settings tree translates into: ``Settings().core_config() == CoreConfig()``, tested in
  ``tests/loadgen/test_fleet_sim.py``) and the rest of ``FleetConfig()``.

What goes in of each file is its code, not its text (:func:`code_of`): the module parsed and printed back
by :mod:`ast` without its comments, docstrings and layout, so a reworded docstring or a reflowed line
leaves the hash (and the document) as it is, while any change to what runs changes it. Stable across
machines and checkouts: files in sorted path order, each with its path; no modification time, absolute
path, Python hash or environment variable goes in.
Not hashed: the versions of Python and the libraries (the simulation uses only the standard library's
seeded ``random`` and the project's own percentiles).

``python -m loadgen.fleet.provenance`` prints the hash; ``--files`` lists the hashed files.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SOURCE_DIRS = ("loadgen/fleet", "loadgen/sim")
"""Folders (relative to the repository) whose every ``.py`` file is hashed, recursively: the fleet
simulation, its experiments and the simulated SGLang workers with their profiles."""

PACKAGES = ("loadgen", "policies", "tenancy", "service")
"""The project's packages: a module of theirs that a hashed file imports is hashed too (the admission core
and the other pure policies the simulated gateway runs, the scenario planner, the report and its request
record, the tenants' quotas), and so on down; nothing else of the project is (a change to, say, worker
discovery leaves the document as it is)."""

NOT_INPUTS = {
    "loadgen.stack": "only its terminate_as_exit: stops the process pool on SIGTERM/SIGHUP; no figure "
    "passes through it",
}
"""Project modules the experiments import that do not change a figure (module -> why)."""

REGENERATE = "flock /tmp/radixgate-heavy.lock .venv/bin/python -m loadgen.fleet.experiments all --write-doc"
"""The command that rewrites every fleet section of the document (25-35 minutes on 2 cores)."""

STAMP = re.compile(r"Code hash: `([0-9a-f]{64})`")
"""How a section records the hash (group 1)."""


def defaults_json() -> str:
    """The experiments' starting configuration as canonical JSON (sorted keys, no spaces).

    ``CoreConfig()`` (the admission core's defaults) and ``FleetConfig()`` (profile, worker count, seeds,
    latencies). Dataclasses only, so :func:`dataclasses.asdict` gives plain values; raises ``TypeError`` if
    a field ever holds something JSON cannot encode (rather than hashing a ``repr`` with an address in it).
    """
    from loadgen.fleet.config import FleetConfig  # here, so that importing this module stays cheap

    return json.dumps(dataclasses.asdict(FleetConfig()), sort_keys=True, separators=(",", ":"))


def _module_file(root: Path, module: str) -> str | None:
    """The file of project module ``module`` under ``root`` (POSIX, relative), or None when it is not one."""
    rel = module.replace(".", "/")
    for cand in (f"{rel}.py", f"{rel}/__init__.py"):
        if (root / cand).is_file():
            return cand
    return None


def _imported_modules(path: Path, module: str) -> tuple[set[str], set[str]]:
    """What ``path`` (module ``module``) imports, anywhere in its code (inside functions too), relative
    imports resolved: (the modules it must find, the names that may be modules): ``import a.b`` and
    ``from a.b import c`` must find ``a.b``; ``c`` may be a module ``a.b.c`` or a name in ``a.b``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    required: set[str] = set()
    optional: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            required.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            required.add(base)
            optional.update(f"{base}.{a.name}" for a in node.names)
    return required, optional


def hashed_files(root: Path = REPO) -> list[str]:
    """Paths (relative to ``root``, POSIX form, sorted) of the files :func:`code_hash` reads: every ``.py``
    file under :data:`SOURCE_DIRS` and every module of :data:`PACKAGES` they import, directly or not
    (with the packages above each), except :data:`NOT_INPUTS` and what only they import.

    Raises ``FileNotFoundError`` when one of :data:`SOURCE_DIRS` is missing, or a module a hashed file
    imports.
    """
    todo: list[str] = []
    for d in SOURCE_DIRS:
        base = root / d
        if not base.is_dir():
            raise FileNotFoundError(f"{base}: a source folder of the fleet experiments is missing")
        found = (p for p in base.rglob("*.py") if "__pycache__" not in p.parts)
        todo.extend(p.relative_to(root).as_posix() for p in found)
    paths: set[str] = set()
    while todo:
        rel = todo.pop()
        if rel in paths:
            continue
        paths.add(rel)
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        parts = module.split(".")
        required, optional = _imported_modules(root / rel, module)
        required |= {".".join(parts[:i]) for i in range(1, len(parts))}  # the packages above it
        for name in sorted(required | optional):
            if name.split(".")[0] not in PACKAGES or name in NOT_INPUTS:
                continue
            found_rel = _module_file(root, name)
            if found_rel is None and name in required:
                raise FileNotFoundError(f"{root / name.replace('.', '/')}.py: {rel} imports it")
            if found_rel is not None and found_rel not in paths:
                todo.append(found_rel)
    return sorted(paths)


def _without_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` with the docstring of the module and of every class and function removed (in place)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0] if body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return tree


def code_of(source: bytes) -> bytes:
    """The code of a Python module, without what does not run: ``ast.unparse`` of it parsed, with the
    docstrings removed (comments, blank lines, quotes and line breaks go with the parse).

    Raises ``SyntaxError`` for a file that is not Python.
    """
    return ast.unparse(_without_docstrings(ast.parse(source))).encode()


def code_hash(root: Path = REPO, defaults: str | None = None) -> str:
    """SHA-256 (64 hex digits) of :func:`hashed_files` under ``root`` and ``defaults`` (default:
    :func:`defaults_json`).

    Each file goes in as its path, a NUL, the length in bytes of its :func:`code_of`, a NUL and that code.
    """
    h = hashlib.sha256()
    for rel in hashed_files(root):
        data = code_of((root / rel).read_bytes())
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    h.update(b"defaults\0" + (defaults_json() if defaults is None else defaults).encode())
    return h.hexdigest()


def stamp(digest: str | None = None) -> str:
    """The line a section of ``docs/experiments.md`` ends with: the hash of the code that wrote it."""
    digest = digest or code_hash()
    return (
        f"Code hash: `{digest}` (`python -m loadgen.fleet.provenance`: SHA-256 of the experiments' sources "
        "and the gateway's defaults they ran with; `tests/loadgen/test_experiments_doc.py` checks it)."
    )


def recorded(section: str) -> str | None:
    """The hash a section's :func:`stamp` records, or None when it has none."""
    m = STAMP.search(section)
    return m.group(1) if m else None


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print the hash (or the hashed files with ``--files``)."""
    ap = argparse.ArgumentParser(prog="python -m loadgen.fleet.provenance", description=__doc__)
    ap.add_argument("--files", action="store_true", help="list the hashed files, one a line")
    args = ap.parse_args(argv)
    print("\n".join(hashed_files()) if args.files else code_hash())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
