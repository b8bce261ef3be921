"""The import rule of ``docs/architecture.md``, read from its rooms table and held against the code.

The table between ``<!-- rooms:start -->`` and ``<!-- rooms:end -->`` names each room (a folder or a module,
relative to the repository root) and the rooms it may import. Every ``import`` and ``from ... import`` of the
project's own packages, at any depth of a module (function bodies and ``TYPE_CHECKING`` blocks too: an import
there is a dependency all the same), is found with :mod:`ast` and checked against it; a module's own room is
always allowed. Modules that import each other, directly or round a longer loop, are found as the strongly
connected components of the module graph (Tarjan, 1972).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("service", "tenancy", "policies", "loadgen")
"""The packages the rooms table covers."""
EVERYWHERE = (*PACKAGES, "tests", "scripts")
"""Where no two modules may import each other."""
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([^|]*)\|")


@dataclass(frozen=True)
class Import:
    """One import statement: the importing module, the module it names, and where."""

    module: str
    target: str
    path: Path
    line: int


def read_rooms(doc: str) -> dict[str, frozenset[str]]:
    """Rooms table of ``doc`` -> {room: rooms it may import}. A room is a dotted module or package name
    (``service/api/`` -> ``service.api``). Raises ValueError when the markers or rows are missing."""
    start, end = "<!-- rooms:start -->", "<!-- rooms:end -->"
    if start not in doc or end not in doc:
        raise ValueError(f"no {start} ... {end} markers")
    rooms: dict[str, frozenset[str]] = {}
    for line in doc[doc.index(start) : doc.index(end)].splitlines():
        match = _ROW.match(line)
        if not match or match.group(1) == "room":
            continue
        allowed = re.findall(r"`([^`]+)`", match.group(2))
        rooms[_dotted(match.group(1))] = frozenset(_dotted(a) for a in allowed)
    if not rooms:
        raise ValueError("the rooms table has no rows")
    return rooms


def _dotted(path: str) -> str:
    return path.strip().strip("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def room_of(module: str, rooms: Iterable[str]) -> str | None:
    """The room holding ``module``: the longest room name that is the module or a package above it."""
    best = None
    for room in rooms:
        if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best)):
            best = room
    return best


def module_name(root: Path, path: Path) -> str:
    """``root/service/api/deps.py`` -> ``service.api.deps`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` (folders under ``root``) -> its file."""
    return {
        module_name(root, path): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[Import]:
    """The project imports of one module, resolved to modules in ``known`` (``from a.b import c`` is
    ``a.b.c`` when that is a module, else ``a.b``); relative imports are resolved against ``module``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
        for name in names:
            target = _known_prefix(name, known)
            if target is not None and target != module:
                yield Import(module, target, path, node.lineno)


def _known_prefix(name: str, known: set[str]) -> str | None:
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def violations(root: Path, rooms: dict[str, frozenset[str]]) -> list[str]:
    """Each import that runs against the rooms table, as ``path:line: a -> b (room x may not import y)``,
    and each module outside every room."""
    modules = project_modules(root)
    known = set(modules)
    found: list[str] = []
    for module, path in modules.items():
        own = room_of(module, rooms)
        if own is None:
            found.append(f"{path.relative_to(root)}: {module} is in no room of the table")
            continue
        for imp in imports_of(module, path, known):
            other = room_of(imp.target, rooms)
            if other is None or other == own or other in rooms[own]:
                continue
            found.append(
                f"{path.relative_to(root)}:{imp.line}: {module} -> {imp.target} "
                f"(room {own} may not import {other})"
            )
    return found


def import_cycles(root: Path, packages: Iterable[str] = EVERYWHERE) -> list[list[str]]:
    """The modules of ``packages`` that import each other, each loop as a sorted list (strongly connected
    components of more than one module, Tarjan's algorithm)."""
    modules = project_modules(root, packages)
    known = set(modules)
    graph = {m: sorted({i.target for i in imports_of(m, p, known)}) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return loops
