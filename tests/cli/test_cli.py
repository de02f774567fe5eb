"""The `kvledger` command line, run as a user would (typer's runner, real databases)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

import migrations
from coordinator.cli.main import app

runner = CliRunner()


def test_demo_shows_the_refusals_and_proves_replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_DATA_DIR", str(tmp_path))
    result = runner.invoke(app, ["demo", "--json"])
    assert result.exit_code == 0, (result.exception, result.output[-2000:])
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    rows = [line for line in lines if "verdict" in line]
    scenarios = [line for line in lines if "scenario" in line]
    assert len(scenarios) >= 12 and all(s["on"]["wrong_reads"] == 0 < s["off"]["wrong_reads"] for s in scenarios)
    assert (tmp_path / "demo" / "partial-hash-hit-on" / "log.sqlite").exists(), "the demo says where its logs are"
    [workload] = [line["workload"] for line in lines if "workload" in line]
    assert workload["wrong_reads"] == 0 and workload["loads_checked"] > 0 and workload["steps"] == 240
    verdicts = {row["verdict"] for row in rows}
    assert {"ok", "refused", "dropped", "violation"} <= verdicts
    shown = " ".join(row["shows"] for row in rows)
    for invariant in ("I1", "I2", "I3", "I4", "I5", "I6", "I7", "I9", "I11", "I13", "I14", "I15", "I16"):
        assert invariant in shown, invariant
    [trace] = [line["trace"] for line in lines if "trace" in line]  # issue 20: beside its reference
    assert trace["requests"] == 1_000 and 0 < trace["hit_blocks"] < trace["blocks"]
    assert (trace["hit_blocks"], trace["refused_stores"]) == (trace["reference_hit_blocks"], trace["reference_refused_stores"])
    table = runner.invoke(app, ["demo", "--core"])
    assert table.exit_code == 0 and "equal (I18 holds)" in table.stdout and "part two" not in table.stdout
    assert f"kvledger's hit rate {trace['hit_rate']:.4f}" in table.stdout and "an LRU reference's" in table.stdout


def test_db_status_and_upgrade_on_sqlite(tmp_path: Path) -> None:
    path = str(tmp_path / "cli.sqlite")
    before = runner.invoke(app, ["db", "status", "--log", path])
    assert before.exit_code == 0 and "schema none" in before.stdout and "behind" in before.stdout
    upgraded = runner.invoke(app, ["db", "upgrade", "--log", path])
    assert upgraded.exit_code == 0 and migrations.head() in upgraded.stdout
    after = runner.invoke(app, ["db", "status", "--log", path])
    assert "up to date" in after.stdout


def test_db_status_names_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "newer.sqlite"
    assert runner.invoke(app, ["db", "upgrade", "--log", str(path)]).exit_code == 0
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_future'")
    status = runner.invoke(app, ["db", "status", "--log", str(path)])
    assert "9999_future" in status.stdout and "NEWER" in status.stdout
    refused = runner.invoke(app, ["db", "upgrade", "--log", str(path)])
    assert refused.exit_code == 1 and "9999_future" in refused.stderr and migrations.head() in refused.stderr


def test_unreachable_database_is_one_line_with_the_password_masked() -> None:
    result = runner.invoke(app, ["db", "status", "--log", "postgresql://kv:s3cret@127.0.0.1:1/nope"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "127.0.0.1:1" in lines[0] and "***" in lines[0]
    assert "s3cret" not in result.stderr + result.stdout
