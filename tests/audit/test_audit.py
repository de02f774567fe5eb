"""The audit index against known truth: a golden log from the simulator's mixed workload (two
engines, preemption, stores, loads, a reset), whose state at any point is what a replay to that
point gives (I18). Every answer checked here is compared with that replayed state or with the
log's own events, never with numbers written into the test."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from coordinator.audit.answers import AuditError, NotFound, OutOfScope
from coordinator.audit.index import entries
from coordinator.audit.queries import Audit, parse_time
from coordinator.audit.store import indexed_seq, sync_index
from coordinator.cli.main import app
from coordinator.core.state import State, state_digest
from coordinator.ledger.recovery import replay
from coordinator.simulator.report import mixed_workload
from events import EngineDeclared, EventCodec, ExternalLoadStarted, KeyPublished, LoadJobStarted, OwnerStarted
from events.log import SqlEventLog, open_log
from events.log.reading import decode, decode_step, stored_steps

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One simulator log for the module (copied per test that writes to it)."""
    directory = tmp_path_factory.mktemp("golden")
    anyio.run(lambda: mixed_workload(engines=2, steps=60, keep=directory))
    return directory / "log.sqlite"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def copy_of(golden: Path, tmp_path: Path) -> Path:
    target = tmp_path / "log.sqlite"
    shutil.copy(golden, target)
    return target


async def step_ends(event_log: SqlEventLog, engine: str) -> list[tuple[int, int]]:
    """(step, last global sequence) of every step of `engine`, from the log itself."""
    async with event_log.engine.connect() as conn:
        rows = await conn.execute(
            sa.text("SELECT step, last_seq FROM kvl_steps WHERE stream_id = :s AND step >= 0 ORDER BY first_seq"),
            {"s": f"engine/{engine}"},
        )
        return [(int(r.step), int(r.last_seq)) for r in rows]


async def state_at(event_log: SqlEventLog, seq: int) -> State:
    state, last = await replay(event_log, EventCodec(), until_seq=seq)
    assert last == seq
    return state


async def test_block_answers_match_the_replayed_state_at_step_ends(golden: Path, tmp_path: Path) -> None:
    event_log = await open_log(str(copy_of(golden, tmp_path)))
    try:
        assert await sync_index(event_log) == await event_log.head()
        audit = Audit(event_log)
        engines = await audit.engines()
        assert engines == ["wl-0", "wl-1"]
        rng = random.Random(3)
        checked = {"held": 0, "free": 0, "never_allocated": 0}
        for engine in engines:
            ends = await step_ends(event_log, engine)
            for step, seq in rng.sample(ends, 6):
                state = await state_at(event_log, seq)
                assert await audit.resolve(engine, at_step=step) == seq
                for pool_id, pool in state.engines[engine].pools.items():
                    for block in range(1, pool.spec.num_blocks):
                        answer = await audit.block(engine, pool_id, block, seq)
                        assert answer.at.step == step
                        generation = pool.generations[block]
                        checked[answer.status] += 1
                        if generation == 0:
                            assert answer.status == "never_allocated"
                            continue
                        assert answer.generation is not None and answer.generation.generation == generation
                        busy = pool.refs[block] > 0 or pool.pins[block] > 0
                        assert answer.status == ("held" if busy else "free"), (engine, pool_id, block, seq)
                        holders = {
                            o.owner_id
                            for o in state.owners.values()
                            if o.engine_id == engine and o.blocks.get(pool_id, {}).get(block) == generation
                        }
                        owner = answer.owner
                        if (
                            owner is not None
                            and (owner.finished_seq is None or owner.finished_seq > seq)
                            and state.owners.get(owner.owner_id) is not None
                        ):
                            assert owner.owner_id in holders, (engine, pool_id, block, seq, holders)
                        pinned = any(job.pinned_then for job in answer.jobs)
                        assert pinned == (pool.pins[block] > 0), (engine, pool_id, block, seq, answer.jobs)
        assert all(checked.values()), checked  # the sample saw held, free and never-allocated slots
    finally:
        await event_log.close()


async def test_history_lists_every_generation_in_order(golden: Path, tmp_path: Path) -> None:
    event_log = await open_log(str(copy_of(golden, tmp_path)))
    try:
        await sync_index(event_log)
        audit = Audit(event_log)
        state = await state_at(event_log, await event_log.head())
        pool = state.engines["wl-0"].pools[0]
        busiest = max(range(1, pool.spec.num_blocks), key=lambda b: pool.generations[b])
        history = await audit.history("wl-0", 0, busiest)
        assert [life.generation for life in history.generations] == list(range(1, pool.generations[busiest] + 1))
        for before, after in zip(history.generations, history.generations[1:]):
            assert before.freed_seq is not None and before.freed_seq <= after.allocated_seq
            assert before.ended_by in ("freed", "reallocated", "reset")
    finally:
        await event_log.close()


async def test_key_provenance_matches_the_tier_and_the_store_job(golden: Path, tmp_path: Path) -> None:
    event_log = await open_log(str(copy_of(golden, tmp_path)))
    try:
        await sync_index(event_log)
        audit = Audit(event_log)
        state = await state_at(event_log, await event_log.head())
        tier = next(iter(state.tiers.values()))
        entries = [(key, entry) for _, key, entry in tier.entries()]
        assert entries
        for key, entry in random.Random(5).sample(entries, min(10, len(entries))):
            answer = await audit.key(key.hex())
            last = answer.publications[-1]
            assert last.checksums == [c.hex() for c in entry.checksums]
            assert last.tier_slot == entry.tier_slot and last.source_job == entry.source_job
            assert answer.namespace_id == entry.namespace_id.hex()
            assert last.source != "?"  # the store job's source slot is known
        loaded = [a for a in [await audit.key(k.hex()) for k, _ in entries] if a.loads]
        assert loaded and all(load.outcome for a in loaded for load in a.loads)
    finally:
        await event_log.close()


async def test_namespace_inventory_dates_are_the_first_publication_and_the_last_use(golden: Path, tmp_path: Path) -> None:
    """A namespace's last use is its last publication or load (a load is its engine's namespace's)."""
    event_log = await open_log(str(copy_of(golden, tmp_path)))
    try:
        await sync_index(event_log)
        codec = EventCodec()
        declared: dict[str, bytes] = {}
        published: dict[bytes, list[float]] = {}
        loaded: dict[bytes, list[float]] = {}
        async for steps in stored_steps(event_log):
            for step in steps:
                for event in decode_step(codec, step):
                    if isinstance(event, EngineDeclared):
                        declared[event.engine_id] = event.namespace_id
                    elif isinstance(event, KeyPublished):
                        published.setdefault(event.namespace_id, []).append(step.recorded_at)
                    elif isinstance(event, (LoadJobStarted, ExternalLoadStarted)):
                        loaded.setdefault(declared[event.engine_id], []).append(step.recorded_at)
        assert published and loaded
        inventory = await Audit(event_log).namespaces(now=0.0)
        assert {bytes.fromhex(entry.namespace_id) for entry in inventory} >= set(published)
        for entry in inventory:
            namespace = bytes.fromhex(entry.namespace_id)
            uses = published.get(namespace, []) + loaded.get(namespace, [])
            assert entry.first_published_at == (min(published[namespace]) if namespace in published else None)
            assert entry.last_used_at == (max(uses) if uses else None)
    finally:
        await event_log.close()


async def test_request_lists_every_owner_lifetime_of_a_req_id(golden: Path, tmp_path: Path) -> None:
    event_log = await open_log(str(copy_of(golden, tmp_path)))
    try:
        await sync_index(event_log)
        codec = EventCodec()
        started: dict[str, list[int]] = {}
        for stored in await event_log.read(0, 1_000_000):
            event = decode(codec, stored)
            if isinstance(event, OwnerStarted):
                started.setdefault(event.req_id, []).append(event.owner_id)
        resumed = [req for req, owners in started.items() if len(owners) > 1]
        assert resumed, "the golden log has a preempted and resumed request"
        audit = Audit(event_log)
        for req_id in resumed[:3] + list(started)[:3]:
            answer = await audit.request(req_id)
            assert sorted(o.owner_id for o in answer.owners) == sorted(started[req_id])
            assert {o.req_id for o in answer.owners} == {req_id}
        with pytest.raises(NotFound):
            await audit.request("no-such-request")
    finally:
        await event_log.close()


async def test_tenant_scope_hides_other_tenants(golden: Path, tmp_path: Path) -> None:
    event_log = await open_log(str(copy_of(golden, tmp_path)))
    try:
        await sync_index(event_log)
        mine = Audit(event_log, tenant="tenant-a")
        other = Audit(event_log, tenant="someone-else")
        assert (await mine.block("wl-0", 0, 1, 100)).tenant == "tenant-a"
        with pytest.raises(OutOfScope):
            await other.block("wl-0", 0, 1, 100)
        with pytest.raises(OutOfScope):
            await other.history("wl-0", 0, 1)
        assert await other.refusals() == [] and await other.namespaces(now=0.0) == []
        assert await other.engines() == [] and await mine.engines() == ["wl-0", "wl-1"]
        with pytest.raises(OutOfScope):
            await other.engine("wl-0")
        with pytest.raises(OutOfScope):  # scope before existence: no step numbers leak
            await other.resolve("wl-0", at_step=100_000)
        with pytest.raises(NotFound, match="engines: none"):
            await other.engine("no-such-engine")
        assert len(await mine.refusals()) == len(await Audit(event_log).refusals())
    finally:
        await event_log.close()


async def test_indexing_is_exactly_once_in_pieces_and_concurrently(golden: Path, tmp_path: Path) -> None:
    async def counts(log: SqlEventLog) -> dict[str, int]:
        """Each table's entries (a packed row holds several, however the batches fell)."""
        async with log.engine.connect() as conn:
            return {
                name: sum(len(entries(name, row)) for row in await conn.execute(sa.text(f"SELECT * FROM kvl_audit_{name}")))
                for name in ("slots", "owner_blocks", "key_blocks", "owners", "jobs", "keys", "refusals", "engines", "steps")
            }

    (tmp_path / "a").mkdir()
    whole = await open_log(str(copy_of(golden, tmp_path / "a")))
    try:
        await sync_index(whole)
        expected = await counts(whole)
        await sync_index(whole)  # nothing new: nothing added
        assert await counts(whole) == expected
    finally:
        await whole.close()
    (tmp_path / "b").mkdir()
    pieces = await open_log(str(copy_of(golden, tmp_path / "b")))
    try:
        head = await pieces.head()
        for until in (head // 7, head // 3, head // 3, head // 2 + 1):
            # Whole steps only: the index stops at the end of the step holding `until`.
            assert until <= await sync_index(pieces, until_seq=until, batch=97) < until + 300
        async with anyio.create_task_group() as group:  # two indexers race over the rest
            for _ in range(2):
                group.start_soon(lambda: sync_index(pieces, batch=500))
        assert await indexed_seq(pieces) == head
        assert await counts(pieces) == expected
    finally:
        await pieces.close()


async def test_point_resolution_rejects_what_it_cannot_answer(golden: Path, tmp_path: Path) -> None:
    event_log = await open_log(str(copy_of(golden, tmp_path)))
    try:
        await sync_index(event_log)
        audit = Audit(event_log)
        with pytest.raises(AuditError, match="2 engines"):
            await audit.engine(None)
        with pytest.raises(NotFound, match="nope"):
            await audit.engine("nope")
        with pytest.raises(AuditError, match="at most one"):
            await audit.resolve("wl-0", at_seq=5, at_step=3)
        with pytest.raises(AuditError, match=">= 0"):
            await audit.resolve("wl-0", at_seq=-1)
        with pytest.raises(NotFound, match="no step 100000"):
            await audit.resolve("wl-0", at_step=100_000)
        with pytest.raises(AuditError, match="not hex"):
            await audit.key("zz")
        with pytest.raises(NotFound):
            await audit.key("00" * 16)
        with pytest.raises(AuditError, match="neither ISO"):
            parse_time("yesterday")
        assert parse_time("1970-01-01T00:01:00") == 60.0
        block = await audit.block("wl-0", 0, 10_000, await event_log.head())
        assert block.status == "never_allocated"
    finally:
        await event_log.close()


# --- the CLI ------------------------------------------------------------------------------------


def test_cli_audit_commands_answer_as_json_and_refuse_bad_input(golden: Path, tmp_path: Path) -> None:
    log = str(copy_of(golden, tmp_path))
    runner = CliRunner()
    result = runner.invoke(app, ["audit", "block", "0", "5", "--engine", "wl-0", "--at-step", "20", "--log", log, "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["engine"] == "wl-0" and answer["at"]["step"] == 20
    for args in (["audit", "history", "0", "5", "--engine", "wl-1"], ["audit", "refusals"], ["audit", "namespaces"]):
        result = runner.invoke(app, [*args, "--log", log, "--json"])
        assert result.exit_code == 0, result.output
        json.loads(result.stdout.strip().splitlines()[-1])
    for args, message in (
        (["audit", "block", "0", "5"], "name one with --engine"),
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-seq", "3", "--at-step", "2"], "at most one"),
        (["audit", "key", "xyz"], "not hex"),
        (["audit", "request", "nobody"], "not in the log"),
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-time", "soon"], "neither ISO"),
    ):
        result = runner.invoke(app, [*args, "--log", log])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and "Traceback" not in result.output


def test_cli_replay_to_a_point_equals_the_state_at_that_point(golden: Path, tmp_path: Path) -> None:
    log = copy_of(golden, tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["replay", "--log", str(log), "--until-seq", "500", "--json", "--out", str(tmp_path / "s.bin")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])

    async def expected() -> str:
        event_log = await open_log(str(log))
        try:
            return state_digest(await state_at(event_log, 500))
        finally:
            await event_log.close()

    assert summary["global_seq"] == 500 and summary["digest"] == anyio.run(expected)
    assert (tmp_path / "s.bin").stat().st_size > 0
    result = runner.invoke(app, ["replay", "--log", str(log), "--until-step", "10", "--engine", "wl-1", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout.strip().splitlines()[-1])["global_seq"] < 500
    result = runner.invoke(app, ["replay", "--log", str(log), "--until-seq", "-4"])
    assert result.exit_code == 2 and ">= 0" in result.output


def test_cli_export_writes_every_event_once_in_order(golden: Path, tmp_path: Path) -> None:
    log = copy_of(golden, tmp_path)
    out = tmp_path / "events.jsonl"
    result = CliRunner().invoke(app, ["export", "--log", str(log), "--format", "jsonl", "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]

    async def head() -> int:
        event_log = await open_log(str(log))
        try:
            return await event_log.head()
        finally:
            await event_log.close()

    assert [line["seq"] for line in lines] == list(range(1, anyio.run(head) + 1))
    published = next(line for line in lines if line["type"] == "key_published")
    bytes.fromhex(published["event"]["key"])  # bytes are hex
    result = CliRunner().invoke(app, ["export", "--log", str(log), "--format", "csv"])
    assert result.exit_code == 2 and "unknown --format" in result.output


def test_cli_verify_passes_a_clean_log_and_fails_an_incident_with_its_evidence(golden: Path, tmp_path: Path) -> None:
    from coordinator.simulator.scenarios import SCENARIOS, run_scenario

    runner = CliRunner()
    result = runner.invoke(app, ["verify", "--log", str(copy_of(golden, tmp_path))])
    assert result.exit_code == 0, result.output
    assert "0 violations" in result.output and "equals the full replay" in result.output
    (tmp_path / "off").mkdir()
    off = anyio.run(
        lambda: run_scenario(SCENARIOS["preempt-during-async-store"], protection_on=False, directory=tmp_path / "off")
    )
    result = runner.invoke(app, ["verify", "--log", off.log, "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] is False and {v["invariant"] for v in report["violations"]} == {"I3"}
    assert all(v["seq"] > 0 and v["evidence"] for v in report["violations"])
    result = runner.invoke(app, ["verify", "--log", str(tmp_path / "missing-dir" / "x" / "log.sqlite")])
    assert result.exit_code == 1 and "Traceback" not in result.output


async def test_long_lists_are_capped_newest_first_with_their_totals(
    golden: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator.audit import queries

    event_log = await open_log(str(copy_of(golden, tmp_path)))
    try:
        await sync_index(event_log)
        audit = Audit(event_log)
        async with event_log.engine.connect() as conn:
            hot = (
                await conn.execute(
                    sa.text("SELECT key, sum(loaded) AS n FROM kvl_audit_key_blocks GROUP BY key ORDER BY n DESC LIMIT 1")
                )
            ).first()
        assert hot is not None and hot.n >= 3
        full = await audit.key(bytes(hot.key).hex())
        monkeypatch.setattr(queries, "LIST_LIMIT", 2)
        capped = await audit.key(bytes(hot.key).hex())
        assert full.counts["loaded"] == capped.counts["loaded"] == hot.n == len(full.loads)
        assert capped.loads == full.loads[-2:]  # the newest two, oldest first
        assert capped.publications == full.publications
    finally:
        await event_log.close()


# --- odd input on the command line: one line and an exit code, never a traceback ------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-time", "-1e12"], "expected a time between 0001-01-01"),
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-time", "1e300"], "expected a time between 0001-01-01"),
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-time", "0001-01-01T00:00:00+01:00"], "expected a time between"),
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-time", "nan"], "expected a finite time"),
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-time", "inf"], "expected a finite time"),
        (["audit", "refusals", "--since", "-inf"], "expected a finite time"),
        (["replay", "--until-time", "-1e12"], "expected a time between"),
    ],
)
def test_cli_times_no_datetime_can_show_are_bad_input(golden: Path, tmp_path: Path, args: list[str], says: str) -> None:
    result = CliRunner().invoke(app, [*args, "--log", str(copy_of(golden, tmp_path))])
    assert result.exit_code == 2, (args, result.output)
    assert says in result.stderr and "Traceback" not in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["audit", "block", "0", "99999999999999999999", "--engine", "wl-0"], "2147483647"),
        (["audit", "block", "2147483648", "1", "--engine", "wl-0"], "2147483647"),
        (["audit", "history", "0", "2147483648", "--engine", "wl-0"], "2147483647"),
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-step", "1e20"], "--at-step"),
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-step", "99999999999999999999"], "9223372036854775807"),
        (["audit", "block", "0", "5", "--engine", "wl-0", "--at-seq", "9223372036854775808"], "9223372036854775807"),
        (["audit", "refusals", "--since-seq", "99999999999999999999"], "9223372036854775807"),
        (["audit", "refusals", "--limit", "99999999999999999999"], "9223372036854775807"),
        (["replay", "--until-seq", "99999999999999999999"], "9223372036854775807"),
        (["replay", "--until-step", "99999999999999999999", "--engine", "wl-0"], "9223372036854775807"),
        (["export", "--after-seq", "99999999999999999999"], "9223372036854775807"),
        (
            ["audit", "timeline", "0", "--steps", "1:99999999999999999999", "--engine", "wl-0", "--out", "{tmp}/t.png"],
            "a step is at most 9223372036854775807",
        ),
    ],
)
def test_cli_numbers_past_what_a_log_holds_are_bad_input(golden: Path, tmp_path: Path, args: list[str], says: str) -> None:
    """Typer bounds them (a sequence or step is a BIGINT, a pool or block an INTEGER): before,
    SQLite raised OverflowError and the command printed a traceback."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = CliRunner().invoke(app, [*args, "--log", str(copy_of(golden, tmp_path))])
    assert result.exit_code == 2, (args, result.output)
    assert says in result.output and "Traceback" not in result.output, result.output
    assert isinstance(result.exception, SystemExit)


def test_cli_replay_and_export_check_the_output_directory_first(golden: Path, tmp_path: Path) -> None:
    log = str(copy_of(golden, tmp_path))
    runner = CliRunner()
    for args in (
        ["replay", "--out", str(tmp_path / "missing" / "state.json")],
        ["export", "--out", str(tmp_path / "missing" / "events.jsonl")],
    ):
        result = runner.invoke(app, [*args, "--log", log])
        assert result.exit_code == 2, result.output
        assert "does not exist" in result.stderr and str(tmp_path / "missing") in result.stderr
        assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "missing").exists()
    for command in ("replay", "export"):
        result = runner.invoke(app, [command, "--out", str(tmp_path), "--log", log])
        assert result.exit_code == 2 and "is a directory" in result.stderr, result.output
    if Path("/dev/full").exists():  # a write that fails (a full disk) is an I/O error: exit 1, the file named
        for command in ("replay", "export"):
            result = runner.invoke(app, [command, "--out", "/dev/full", "--log", log])
            assert result.exit_code == 1, result.output
            assert "/dev/full" in result.stderr and "Traceback" not in result.output


async def test_a_store_decided_without_its_pin_is_not_shown_as_pinning(tmp_path: Path) -> None:
    """With the PINS protection off (a simulator run of seed 000), a store is decided with
    pinned=False: `audit block` must not claim it pinned the slot while in flight."""
    from coordinator.core.commands import AllocateBlocks, MarkComputed, StartOwner, StartStore
    from coordinator.core.protections import Protection
    from coordinator.ledger.ledger import Ledger
    from events import BlocksAllocated, StoreJobStarted
    from tests.kit import builders as b
    from tests.kit.sidecar import TIER_SPEC, declaration

    event_log = await open_log(str(tmp_path / "unpinned.sqlite"))
    try:

        async def stored_while_in_flight(off: frozenset[Protection], engine: str) -> tuple[StoreJobStarted, int]:
            ledger = await Ledger.open(event_log, protections_off=off)
            from coordinator.core.commands import DeclareTier

            await ledger.execute(DeclareTier(spec=TIER_SPEC))
            await ledger.execute(declaration(engine))
            commit = await ledger.run_step(engine, 1, 1.0, [StartOwner(engine_id=engine, req_id="r")])
            owner = next(e for e in commit.events if isinstance(e, OwnerStarted)).owner_id
            commit = await ledger.run_step(engine, 2, 2.0, [AllocateBlocks(engine_id=engine, owner_id=owner, pool_id=0, count=1)])
            blocks = next(e for e in commit.events if isinstance(e, BlocksAllocated)).blocks
            commit = await ledger.run_step(
                engine,
                3,
                3.0,
                [
                    MarkComputed(engine_id=engine, owner_id=owner, blocks=blocks, token_ids=list(range(b.BLOCK))),
                    StartStore(engine_id=engine, tier=b.TIER, blocks=blocks),
                ],
            )
            job = next(e for e in commit.events if isinstance(e, StoreJobStarted))
            assert job.pinned == (Protection.PINS not in off)
            return job, commit.last_seq

        pinned_job, pinned_at = await stored_while_in_flight(frozenset(), "pinned")
        unpinned_job, unpinned_at = await stored_while_in_flight(frozenset({Protection.PINS}), "unpinned")
        await sync_index(event_log)
        audit = Audit(event_log)
        for engine, job, seq, expected in (
            ("pinned", pinned_job, pinned_at, True),
            ("unpinned", unpinned_job, unpinned_at, False),
        ):
            source = job.items[0].source
            answer = await audit.block(engine, source.pool_id, source.block_id, seq)
            [touch] = [j for j in answer.jobs if j.job_id == job.job_id]
            assert touch.outcome == "in flight" and touch.pinned_then is expected, (engine, touch)
    finally:
        await event_log.close()
