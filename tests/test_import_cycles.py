"""No two modules of the project import each other, directly or through others (the house rules).

``loadgen.fleet.experiments`` and ``loadgen.fleet.experiments_load`` did on 2734630: what both need now lives
in ``loadgen.fleet.experiments_common``. Imports for type checking only (``if TYPE_CHECKING:``) are not
counted: they never run.
"""

from __future__ import annotations

import grimp

PACKAGES = ("service", "tenancy", "policies", "loadgen")


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    cycles = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.add(" -> ".join((module, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))
