"""``docs/experiments.md`` shows what the code gives: each fleet section records the hash of the code that
wrote it (``loadgen.fleet.provenance``), and the experiments write the document only when asked.

The first test is the fast check (no experiment runs): it fails when the experiments' code or the defaults
they run with changed and the document was not regenerated in the same change.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from loadgen.fleet import experiments_load, provenance
from loadgen.fleet.doc import DOC, REPO
from loadgen.fleet.experiments import main as experiments_main
from loadgen.fleet.experiments import registry

SECTIONS = ("workers", "routing", "overload", "fairness", "models", "replicas", "planner")


def section(text: str, name: str) -> str | None:
    """The body of section ``name`` of the document, or None when it has none."""
    m = re.search(rf"<!-- fleet:{name} -->\n(.*?)<!-- /fleet:{name} -->", text, re.S)
    return m.group(1) if m else None


def test_every_fleet_section_records_the_code_that_wrote_it() -> None:
    """On 2734630 no section recorded its code, and rerun, the routing experiment gave other figures in
    every row (SLO rate 356 RPS against the 306 shown): the code had changed since the document."""
    assert set(registry()) == set(SECTIONS)
    now = provenance.code_hash()
    text = DOC.read_text()
    stale = []
    for name in SECTIONS:
        body = section(text, name)
        got = provenance.recorded(body) if body is not None else None
        if got != now:
            stale.append(f"{name} (recorded {got or 'no hash'})")
    assert not stale, (
        f"docs/experiments.md is out of step with the code (hash now {now}): sections {', '.join(stale)}. "
        f"Regenerate it in the same change: `{provenance.REGENERATE}` (one experiment: `... experiments "
        "NAME --write-doc`); `python -m loadgen.fleet.provenance --files` lists what the hash covers"
    )


def copy_sources(dest: Path) -> None:
    """The hashed files of the repository, at the same relative paths under ``dest``."""
    for rel in provenance.hashed_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, dest / rel)


def test_the_hash_follows_the_contents_and_the_defaults_not_times_or_places(tmp_path: Path) -> None:
    copy_sources(tmp_path)
    base = provenance.code_hash()
    assert provenance.code_hash(tmp_path) == base  # another folder, other modification times
    core = tmp_path / "policies" / "admission_core.py"
    os.utime(core, (1, 1))
    assert provenance.code_hash(tmp_path) == base
    core.write_bytes(core.read_bytes().replace(b"\n", b"\r\n"))  # a Windows checkout
    assert provenance.code_hash(tmp_path) == base
    text = core.read_bytes()
    core.write_bytes(text + b"# a comment\n\n\n")  # neither a comment nor blank lines run
    assert provenance.code_hash(tmp_path) == base
    reworded = text.replace(b'"""', b'"""Reworded. ', 1)  # the module's docstring
    assert reworded != text
    core.write_bytes(reworded)
    assert provenance.code_hash(tmp_path) == base
    core.write_bytes(text + b"ONE_MORE = 1\n")  # code
    assert provenance.code_hash(tmp_path) != base
    shutil.copyfile(REPO / "policies" / "admission_core.py", core)
    assert provenance.code_hash(tmp_path) == base
    (tmp_path / "loadgen" / "sim" / "new_model.py").write_text("X = 1\n")  # a new file in a hashed folder
    assert provenance.code_hash(tmp_path) != base
    (tmp_path / "loadgen" / "sim" / "new_model.py").unlink()
    elsewhere = tmp_path / "policies" / "not_imported_by_the_fleet.py"  # a policy the experiments never run
    elsewhere.write_text("X = 1\n")
    assert provenance.code_hash(tmp_path) == base
    (tmp_path / "policies" / "routing.py").write_text(  # a hashed module now imports it
        (REPO / "policies" / "routing.py").read_text() + "\nfrom policies import not_imported_by_the_fleet\n"
    )
    assert "policies/not_imported_by_the_fleet.py" in provenance.hashed_files(tmp_path)
    elsewhere.write_text("X = 2\n")
    changed = provenance.code_hash(tmp_path)
    elsewhere.write_text("X = 1\n")
    assert provenance.code_hash(tmp_path) != changed
    shutil.copyfile(REPO / "policies" / "routing.py", tmp_path / "policies" / "routing.py")
    elsewhere.unlink()
    assert provenance.code_hash(tmp_path) == base
    assert provenance.code_hash(tmp_path, provenance.defaults_json().replace("0.99", "0.98")) != base
    (tmp_path / "loadgen" / "scenario.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"scenario\.py"):
        provenance.code_hash(tmp_path)


def test_the_defaults_in_the_hash_are_the_admission_cores() -> None:
    """A changed default of the gateway's admission core (``CoreConfig``, which the Settings tree translates
    into) changes the figures, so it changes the hash."""
    assert '"calibration_target":0.99' in provenance.defaults_json()
    assert '"routing":"cache_aware"' in provenance.defaults_json()


def test_the_hash_is_the_same_in_every_process_and_environment(tmp_path: Path) -> None:
    """Another process (another ``hash()`` seed), working folder, HOME and RADIXGATE_ settings: same hash."""
    env = {
        **os.environ,
        "PYTHONHASHSEED": "12345",
        "HOME": str(tmp_path),
        "RADIXGATE_ROUTING__POLICY": "round_robin",
        "RADIXGATE_SCHEDULER__PREDICTION_CALIBRATION_TARGET": "0",
        "PYTHONPATH": str(REPO),  # this checkout's code, whichever the virtualenv has installed
    }
    out = subprocess.run(
        [sys.executable, "-m", "loadgen.fleet.provenance"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == provenance.code_hash()


def module_file(graph: grimp.ImportGraph, module: str) -> str:
    """A module's path relative to the repository (a package's ``__init__.py``)."""
    rel = module.replace(".", "/")
    return f"{rel}/__init__.py" if graph.find_children(module) or (REPO / rel).is_dir() else f"{rel}.py"


def test_the_hash_covers_every_project_module_the_experiments_import() -> None:
    """The import graph (grimp; imports inside functions too, not those only for type checking): every
    project module that ``loadgen.fleet`` imports, directly or not, is hashed or named in NOT_INPUTS."""
    graph = grimp.build_graph(
        "loadgen", "policies", "tenancy", "service", exclude_type_checking_imports=True, cache_dir=None
    )
    for module in provenance.NOT_INPUTS:
        graph.remove_module(module)  # and what only it imports
    fleet = {"loadgen.fleet", *graph.find_descendants("loadgen.fleet")}
    upstream = set().union(*(graph.find_upstream_modules(m) for m in fleet)) | fleet
    hashed = set(provenance.hashed_files())
    missing = sorted(f for f in map(functools.partial(module_file, graph), upstream) if f not in hashed)
    assert not missing, f"add to loadgen.fleet.provenance.SOURCE_FILES (or NOT_INPUTS, with why): {missing}"


def tracked_state() -> tuple[str, dict[str, tuple[int, int]]]:
    """``git status`` of the repository and (mtime ns, size) of every file under docs/."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = {
        str(p.relative_to(REPO)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in (REPO / "docs").rglob("*")
        if p.is_file()
    }
    return status, files


def test_the_experiments_write_the_document_only_with_write_doc(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On 2734630 ``python -m loadgen.fleet.experiments routing --json`` rewrote docs/experiments.md and
    docs/img/fleet-routing.png. The routing experiment runs here at a tiny scale (1 worker, 2 prompts,
    4 s)."""
    tiny = functools.partial(experiments_load.routing_figures, workers=1, hi=20.0, steps=1, scale=(4, 1, 2))
    monkeypatch.setattr(experiments_load, "routing_figures", tiny)
    before = tracked_state()
    assert experiments_main(["routing", "--json"]) == 0
    assert '"policy": "cache_aware"' in capsys.readouterr().out
    assert tracked_state() == before, "the experiments wrote files without --write-doc"

    doc = tmp_path / "experiments.md"
    written = []
    for _ in range(2):
        assert experiments_main(["routing", "--write-doc", "--doc", str(doc)]) == 0
        written.append((doc.read_bytes(), (tmp_path / "img" / "fleet-routing.png").read_bytes()))
    assert tracked_state() == before, "--doc elsewhere wrote into the repository"
    body = section(doc.read_text(), "routing")
    assert body is not None and provenance.recorded(body) == provenance.code_hash()
    assert "![served vs offered](img/fleet-routing.png)" in body
    assert written[0] == written[1], "the same figures gave another document or plot"
    png = written[0][1]
    assert png.startswith(b"\x89PNG") and b"Software" not in png and b"matplotlib" not in png


def routing_head(policy: str, served: dict[str, float], peak: float) -> dict[str, object]:
    """A routing headline as ``routing_figures`` gives it (the figures of the run on 2734630's code)."""
    return {
        "policy": policy,
        "slo_rps": 355.6,
        "peak_served_rps": peak,
        "served_rps_at": served,
        "served_share_of_peak_at": {m: x / peak for m, x in served.items()},
        "hit_rate_at": dict.fromkeys(served, 0.977),
        "hit_rate_at_slo": 0.981,
    }


def test_the_routing_section_says_where_the_served_goal_is_missed(tmp_path: Path) -> None:
    """2x served 418.6 of a 441.24 peak (94.9%); the section printed "(95% of peak)" and no verdict."""
    run = {
        "rate": 711.25,
        "hit_rate": 0.977,
        "p50": 314.0,
        "p99": 664.0,
        "goodput": 0.565,
        "shed_rate": 0.414,
        "throughput_rps": 418.6,
        "good_rps": 404.0,
        "imbalance": 1.1,
    }
    heads = [
        routing_head("cache_aware", {"1.5": 433.28, "2.0": 418.6, "3.0": 441.24}, 441.24),
        routing_head("least_load", {"1.5": 440.0, "2.0": 419.2, "3.0": 430.0}, 441.24),  # 95.0%: met
    ]
    doc = tmp_path / "experiments.md"
    experiments_load.write_routing(doc, heads, {"cache_aware": [run], "least_load": [run]})
    body = section(doc.read_text(), "routing")
    assert body is not None
    lines = {line.split("**")[1]: line for line in body.splitlines() if line.startswith("- **")}
    assert "at 2.0x served 419 RPS (94.8% of peak)" in lines["cache_aware"]
    assert "**missed** at 2.0x (94.8%)" in lines["cache_aware"]
    assert "(95.0% of peak)" in lines["least_load"] and lines["least_load"].endswith("multiple): met.")
