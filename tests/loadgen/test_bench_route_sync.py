"""``python -m loadgen bench-route-sync``: it measures what it says, and its command line works."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from loadgen.bench.route_sync import _prompts, measure
from loadgen.cli import app


def test_it_measures_both_inserts_against_each_other() -> None:
    m = measure(routes=400)
    assert m["routes"] == 400 and 1200 < m["prompt_chars"] < 1700
    assert m["own_commit_us"] > 0 and m["peer_insert_us"] > 0 and m["wire_us"] > 0
    assert abs(m["peer_over_own"] - m["peer_insert_us"] / m["own_commit_us"]) < 1e-9


def test_the_prompts_share_system_prompts_and_differ_after_them() -> None:
    prompts = _prompts(40)
    assert len(set(prompts)) == 40
    assert prompts[0].split("<|im_end|>")[0] == prompts[20].split("<|im_end|>")[0]


def test_the_command_prints_json_and_refuses_a_bad_count() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["bench-route-sync", "--routes", "200", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["routes"] == 200
    bad = runner.invoke(app, ["bench-route-sync", "--routes", "5"])
    assert bad.exit_code == 2 and "routes" in bad.output.lower()
