"""Namespace release decisions (seed 003): new, compatible, clear, and releasing abandoned
namespaces; their refusals, their audit records, and the `kvledger namespace` commands.

The pure-core tests drive CoordinatorCore; the log tests drive a real Ledger on a SQLite file
whose clock places each step in time (no sleeps); the CLI runs as a user runs it, on a log file
and through a real sidecar.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
from typer.testing import CliRunner

from coordinator.audit.answers import OutOfScope
from coordinator.audit.queries import Audit
from coordinator.audit.store import sync_index
from coordinator.cli.namespace import namespace_app, parse_duration
from coordinator.client import Address, EngineClient, OperatorClient, SidecarError
from coordinator.core import CoordinatorCore
from coordinator.core.commands import (
    AllocateBlocks,
    DecideNamespace,
    DeclareEngine,
    DeclareTier,
    FinishOwner,
    LoadRequest,
    LookupPrefix,
    MarkComputed,
    ReleaseNamespace,
    ReportRank,
    ResetCache,
    StartLoad,
    StartOwner,
    StartStore,
)
from coordinator.core.keys import namespace_id
from coordinator.core.step import NAMESPACE_STREAM
from coordinator.ledger.ledger import Ledger
from coordinator.sidecar import protocol as p
from coordinator.sidecar.embedded import embedded_sidecar
from events import (
    BlocksAllocated,
    Event,
    JobFailed,
    KeyEvicted,
    KeyQuarantined,
    LoadJobStarted,
    NamespaceDecided,
    NamespaceReleased,
    NamespaceSpec,
    OwnerStarted,
    PrefixLookedUp,
    Reason,
    Refused,
    StoreJobStarted,
    TierSpec,
)
from events.log import SqlEventLog, open_log, upgrade_log
from tests.kit import builders as b

ROOT = Path(__file__).resolve().parents[2]
TOKENS = list(range(100, 108))  # two attention blocks of 4 tokens
DAY = 86_400.0
T0 = 1_800_000_000.0  # 2027-01-15: the recorded time of the first step in the log tests

runner = CliRunner()


def spec(tenant: str = "tenant-a", weights: str = "sha256:1111") -> NamespaceSpec:
    return b.namespace(tenant, (b.BLOCK,), tp=2, weights_revision=weights)


A, B, OTHER_TENANT = spec(), spec(weights="sha256:9999"), spec(tenant="tenant-b", weights="sha256:9999")
A_ID, B_ID, OTHER_ID = (namespace_id(ns) for ns in (A, B, OTHER_TENANT))


def declaration(engine_id: str, namespace: NamespaceSpec) -> DeclareEngine:
    return DeclareEngine(engine_id=engine_id, namespace=namespace, pools=[b.attention_pool()], world_size=2, tiers=[b.TIER])


def three_engines() -> CoordinatorCore:
    """engine-a in namespace A, engine-b in B (a new release of the same tenant's model: other
    weights), engine-c in another tenant's namespace; each with a step open."""
    core = CoordinatorCore()
    core.execute(DeclareTier(spec=TierSpec(name=b.TIER, num_slots=16, bytes_per_slot=64)))
    for engine_id, namespace in (("engine-a", A), ("engine-b", B), ("engine-c", OTHER_TENANT)):
        b.ok(core.execute(declaration(engine_id, namespace)))
        b.begin(core, engine_id=engine_id)
    return core


def lookup(core: CoordinatorCore, engine_id: str, tokens: list[int] = TOKENS) -> PrefixLookedUp:
    [event] = b.ok(core.execute(LookupPrefix(engine_id=engine_id, tier=b.TIER, token_ids=tokens)))
    assert isinstance(event, PrefixLookedUp)
    return event


def decide(
    outcome: str,
    source: bytes | str = A_ID,
    target: bytes | str = B_ID,
    evidence: str = "",
    reason: str = "release 2027-01: new weights",
) -> DecideNamespace:
    def text(value: bytes | str) -> str:
        return value.hex() if isinstance(value, bytes) else value

    return DecideNamespace(
        from_namespace=text(source), to_namespace=text(target), outcome=outcome, reason=reason, evidence=evidence
    )


def of_type(events: Sequence[Event], kind: type[Event]) -> list[Event]:
    return [e for e in events if isinstance(e, kind)]


# --- outcomes on the pure core -----------------------------------------------------------------------


def test_new_records_the_decision_and_changes_nothing() -> None:
    """B is a new namespace: A's keys stay A's, and are never B's hits (I9)."""
    core = three_engines()
    b.publish(core, TOKENS, engine_id="engine-a")
    before = b.state_bytes(core)
    events = b.ok(core.execute(decide("new")))
    assert events == [
        NamespaceDecided(from_namespace=A_ID, to_namespace=B_ID, outcome="new", rationale="release 2027-01: new weights")
    ]
    assert b.state_bytes(core) == before
    assert lookup(core, "engine-a").boundary == 8 and lookup(core, "engine-b").boundary == 0
    assert b.replay_matches(core)


def test_compatible_needs_evidence_and_is_recorded_not_aliased() -> None:
    """Seed 003: compatible reuse is a verified decision. Without the verification run it is
    refused; with it, it is recorded (with its evidence) and B's lookups still hit only B's keys:
    kvledger records the decision and does not alias A's keys into B."""
    core = three_engines()
    b.publish(core, TOKENS, engine_id="engine-a")
    refused = b.rejected(core, decide("compatible"), Refused, Reason.MISSING_EVIDENCE)
    assert isinstance(refused, Refused) and "--evidence" in refused.detail and refused.command == "decide_namespace"
    b.rejected(core, decide("compatible", evidence="   "), Refused, Reason.MISSING_EVIDENCE)
    before = b.state_bytes(core)
    [decided] = b.ok(core.execute(decide("compatible", evidence="eval-run-4711")))
    assert isinstance(decided, NamespaceDecided) and (decided.outcome, decided.evidence) == ("compatible", "eval-run-4711")
    assert b.state_bytes(core) == before
    assert lookup(core, "engine-b").boundary == 0  # recorded, not aliased
    assert b.replay_matches(core)


def test_clear_quarantines_every_key_of_a_and_no_one_loads_them() -> None:
    core = three_engines()
    a_keys = b.publish(core, TOKENS, engine_id="engine-a")
    b_keys = b.publish(core, TOKENS, engine_id="engine-b")
    # A load of A's first key is in flight when the clear lands: it must not count (I13).
    reader = b.owner(core, "reader", engine_id="engine-a")
    [dest, dest2] = b.allocate(core, reader, 2, engine_id="engine-a")
    [in_flight] = b.ok(core.execute(StartLoad(engine_id="engine-a", tier=b.TIER, items=[LoadRequest(a_keys[0], dest)])))
    assert isinstance(in_flight, LoadJobStarted)

    events = b.ok(core.execute(decide("clear")))
    decided, *quarantines = events
    assert isinstance(decided, NamespaceDecided) and decided.outcome == "clear" and decided.affected_keys == 2
    assert [(q.key, q.reason) for q in quarantines if isinstance(q, KeyQuarantined)] == [
        (key, Reason.NAMESPACE_CLEARED) for key in a_keys
    ]
    tier = core.state.tiers[b.TIER]
    assert all(tier.entry(0, key).quarantined for key in a_keys)  # type: ignore[union-attr]
    assert not any(tier.entry(0, key).quarantined for key in b_keys)  # type: ignore[union-attr]
    assert lookup(core, "engine-a").boundary == 0 and lookup(core, "engine-b").boundary == 8
    b.rejected(
        core, StartLoad(engine_id="engine-a", tier=b.TIER, items=[LoadRequest(a_keys[1], dest2)]), Refused, Reason.KEY_QUARANTINED
    )
    reports = b.report_all(core, in_flight.job_id, [a_keys[0]])
    assert isinstance(reports[-1], JobFailed) and reports[-1].reason == Reason.KEY_QUARANTINED
    assert core.state.engines["engine-a"].pools[0].keys[dest.block_id] is None
    # A second clear has nothing left to quarantine, and says so.
    [again] = b.ok(core.execute(decide("clear", reason="again")))
    assert isinstance(again, NamespaceDecided) and again.affected_keys == 0
    assert b.replay_matches(core)


def test_release_evicts_every_key_of_the_namespace_only() -> None:
    core = three_engines()
    a_keys = b.publish(core, TOKENS, engine_id="engine-a")
    b_keys = b.publish(core, TOKENS, engine_id="engine-b")
    free_before = len(core.state.tiers[b.TIER].free)
    events = b.ok(core.execute(ReleaseNamespace(namespace=A_ID.hex(), reason="gc: unused for 9 days")))
    released, *evictions = events
    assert released == NamespaceReleased(namespace_id=A_ID, rationale="gc: unused for 9 days", evicted_keys=2)
    assert [e.key for e in evictions if isinstance(e, KeyEvicted)] == a_keys
    tier = core.state.tiers[b.TIER]
    assert all(tier.entry(0, key) is None for key in a_keys) and all(tier.entry(0, key) for key in b_keys)
    assert len(tier.free) == free_before + 2
    dest = b.allocate(core, b.owner(core, "reader", engine_id="engine-a"), 1, engine_id="engine-a")[0]
    b.rejected(
        core,
        StartLoad(engine_id="engine-a", tier=b.TIER, items=[LoadRequest(a_keys[0], dest)]),
        Refused,
        Reason.KEY_NOT_PUBLISHED,
    )
    assert lookup(core, "engine-a").boundary == 0 and lookup(core, "engine-b").boundary == 8
    b.end(core, "engine-a")  # the evictions happened outside any step: no removal notice is owed
    assert b.replay_matches(core)


def test_I12_release_never_evicts_a_key_under_a_live_lease() -> None:
    core = three_engines()
    a_keys = b.publish(core, TOKENS, engine_id="engine-a")
    dest = b.allocate(core, b.owner(core, "reader", engine_id="engine-a"), 1, engine_id="engine-a")[0]
    [job] = b.ok(
        core.execute(StartLoad(engine_id="engine-a", tier=b.TIER, items=[LoadRequest(a_keys[0], dest)], lease_seconds=5.0))
    )
    assert isinstance(job, LoadJobStarted)
    refused = b.rejected(core, ReleaseNamespace(namespace=A_ID.hex(), reason="gc"), Refused, Reason.NAMESPACE_IN_USE)
    assert isinstance(refused, Refused) and str(job.job_id) in refused.detail
    # Past the lease on the loading engine's clock the key may go; the late load then fails (I12).
    b.end(core, "engine-a")
    b.begin(core, clock=10.0, engine_id="engine-a")
    released, *_ = b.ok(core.execute(ReleaseNamespace(namespace=A_ID.hex(), reason="gc")))
    assert isinstance(released, NamespaceReleased) and released.evicted_keys == 2
    reports = b.report_all(core, job.job_id, [a_keys[0]])
    assert isinstance(reports[-1], JobFailed) and reports[-1].reason == Reason.LEASE_EXPIRED
    assert b.replay_matches(core)


# --- bad input: a typed refusal, the state unchanged --------------------------------------------------


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        (decide("new", source="zz" + A_ID.hex()[2:]), Reason.INVALID_ARGUMENT),  # bad hex
        (decide("new", target="not hex"), Reason.INVALID_ARGUMENT),
        (decide("new", source=""), Reason.INVALID_ARGUMENT),
        (decide("new", source=bytes(16)), Reason.UNKNOWN_NAMESPACE),
        (decide("new", target=A_ID.hex()[:-2]), Reason.UNKNOWN_NAMESPACE),
        (decide("clear", source=bytes(16)), Reason.UNKNOWN_NAMESPACE),  # a clear of an unknown namespace
        (decide("new", target=A_ID), Reason.INVALID_ARGUMENT),  # from == to
        (decide("clear", target=A_ID.hex().upper()), Reason.INVALID_ARGUMENT),  # the same id, in capitals
        (decide("compatible"), Reason.MISSING_EVIDENCE),
        (decide("compatible", target=OTHER_ID, evidence="eval-run-1"), Reason.CROSS_TENANT),  # I9
        (decide("new", target=OTHER_ID), Reason.CROSS_TENANT),
        (decide("clear", target=OTHER_ID), Reason.CROSS_TENANT),
        (decide("alias", evidence="eval-run-1"), Reason.INVALID_ARGUMENT),  # no such outcome
        (decide("new", reason="  "), Reason.INVALID_ARGUMENT),  # a decision says why
        (decide("compatible", evidence="x" * 256), Reason.INVALID_ARGUMENT),
        (ReleaseNamespace(namespace=bytes(16).hex(), reason="gc"), Reason.UNKNOWN_NAMESPACE),
        (ReleaseNamespace(namespace="0x12", reason="gc"), Reason.INVALID_ARGUMENT),
        (ReleaseNamespace(namespace=A_ID.hex(), reason=""), Reason.INVALID_ARGUMENT),
    ],
    ids=lambda value: getattr(value, "value", None) or "",
)
def test_bad_input_is_refused_with_the_state_unchanged(command: DecideNamespace | ReleaseNamespace, reason: Reason) -> None:
    core = three_engines()
    b.publish(core, TOKENS, engine_id="engine-a")
    event = b.rejected(core, command, Refused, reason)
    assert isinstance(event, Refused) and event.engine_id == "" and event.detail
    assert b.replay_matches(core)


def test_a_cross_tenant_refusal_names_no_tenant() -> None:
    core = three_engines()
    event = b.rejected(core, decide("compatible", target=OTHER_ID, evidence="run"), Refused, Reason.CROSS_TENANT)
    assert isinstance(event, Refused) and "tenant-a" not in event.detail and "tenant-b" not in event.detail


# --- durations ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("7d", 7 * DAY),
        ("12h", 43_200),
        ("30m", 1800),
        ("45s", 45),
        ("2w", 14 * DAY),
        ("1d12h", 1.5 * DAY),
        ("1.5h", 5400),
        (" 7D ", 7 * DAY),
    ],
)
def test_a_duration_in_weeks_days_hours_minutes_or_seconds_is_read_as_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "d", "7x", "-7d", "7d 12h", "0d", "0s0m", "seven days", "7dd"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


# --- on the log: the audit index, gc, the CLI ------------------------------------------------------------


class Clock:
    """The wall clock the ledger stamps on each step (`recorded_at`), set by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def _publish(ledger: Ledger, engine_id: str, tokens: list[int]) -> list[bytes]:
    """Admit, allocate, compute and store one request's blocks, then report every rank."""
    engine = ledger.state.engines[engine_id]
    step, clock = engine.step + 1, engine.clock + 1.0
    commit = await ledger.run_step(engine_id, step, clock, [StartOwner(engine_id=engine_id, req_id=f"{engine_id}-req")])
    owner = next(e for e in commit.events if isinstance(e, OwnerStarted)).owner_id
    commit = await ledger.run_step(
        engine_id, step + 1, clock, [AllocateBlocks(engine_id=engine_id, owner_id=owner, pool_id=0, count=len(tokens) // b.BLOCK)]
    )
    blocks = next(e for e in commit.events if isinstance(e, BlocksAllocated)).blocks
    commit = await ledger.run_step(
        engine_id,
        step + 2,
        clock,
        [
            MarkComputed(engine_id=engine_id, owner_id=owner, blocks=blocks, token_ids=tokens),
            StartStore(engine_id=engine_id, tier=b.TIER, blocks=blocks),
        ],
    )
    job = next(e for e in commit.events if isinstance(e, StoreJobStarted))
    reports = [
        ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
        for rank in (0, 1)
    ]
    await ledger.run_step(engine_id, step + 3, clock, [*reports, FinishOwner(engine_id=engine_id, owner_id=owner)])
    return [item.key for item in job.items]


async def _build_log(path: Path | str) -> dict[str, list[bytes]]:
    """A log where namespace A was last used at T0, B at T0 + 10 days, the other tenant's at
    T0 + 1 day. Returns each engine's published keys."""
    clock = Clock(T0)
    if str(path).startswith("postgresql"):
        await upgrade_log(str(path))
    event_log = await open_log(str(path))
    try:
        ledger = await Ledger.open(event_log, clock=clock)
        await ledger.execute(DeclareTier(spec=TierSpec(name=b.TIER, num_slots=16, bytes_per_slot=64)))
        keys = {}
        for engine_id, namespace, at in (
            ("engine-a", A, T0),
            ("engine-c", OTHER_TENANT, T0 + DAY),
            ("engine-b", B, T0 + 10 * DAY),
        ):
            clock.now = at
            await ledger.execute(declaration(engine_id, namespace))
            keys[engine_id] = await _publish(ledger, engine_id, TOKENS)
        return keys
    finally:
        await event_log.close()


async def _state_keys(path: Path) -> dict[bytes, list[bytes]]:
    """Namespace id -> its published keys, in the state recovered from the log."""
    event_log = await open_log(str(path))
    try:
        ledger = await Ledger.open(event_log)
        found: dict[bytes, list[bytes]] = {}
        for _, key, entry in ledger.state.tiers[b.TIER].entries():
            found.setdefault(entry.namespace_id, []).append(key)
        return found
    finally:
        await event_log.close()


@pytest.mark.anyio
async def test_decisions_are_in_the_log_and_the_audit_index(log_url: str) -> None:
    """On each backend (kvl_audit_decisions is a table of the audit index)."""
    keys = await _build_log(log_url)
    event_log = await open_log(log_url)
    try:
        assert isinstance(event_log, SqlEventLog)
        ledger = await Ledger.open(event_log, clock=Clock(T0 + 11 * DAY))
        commit = await ledger.execute(decide("clear", reason="weights changed under the same name"), command_id="/d1")
        assert commit.stream_id == NAMESPACE_STREAM and len(of_type(commit.events, KeyQuarantined)) == 2
        refused = await ledger.execute(decide("compatible", source=B_ID, target=A_ID))
        assert [e.reason for e in refused.events if isinstance(e, Refused)] == [Reason.MISSING_EVIDENCE]
        await ledger.execute(decide("compatible", source=B_ID, target=A_ID, evidence="eval-run-7", reason="same tensors"))
        await ledger.execute(ReleaseNamespace(namespace=OTHER_ID.hex(), reason="gc: tenant-b left"))
        retry = await ledger.execute(decide("clear", reason="weights changed under the same name"), command_id="/d1")
        assert retry.duplicate and retry.first_seq == commit.first_seq

        await sync_index(event_log)
        audit = Audit(event_log)
        decisions = await audit.decisions()
        assert [(d.outcome, d.from_namespace, d.to_namespace, d.affected_keys, d.evidence, d.tenant) for d in decisions] == [
            ("clear", A_ID.hex(), B_ID.hex(), 2, "", "tenant-a"),
            ("compatible", B_ID.hex(), A_ID.hex(), 0, "eval-run-7", "tenant-a"),
            ("released", OTHER_ID.hex(), None, 2, "", "tenant-b"),
        ]
        assert decisions[0].reason == "weights changed under the same name" and decisions[0].recorded_at == T0 + 11 * DAY
        assert [d.outcome for d in await audit.decisions(A_ID.hex())] == ["clear", "compatible"]
        inventory = {e.namespace_id: e for e in await audit.namespaces(now=T0 + 11 * DAY)}
        assert [d.outcome for d in inventory[A_ID.hex()].decisions] == ["clear", "compatible"]
        assert inventory[OTHER_ID.hex()].keys == 0 and [d.outcome for d in inventory[OTHER_ID.hex()].decisions] == ["released"]
        refusals = await audit.refusals()
        assert any(r.reason == "missing_evidence" and r.subject == "decide_namespace" for r in refusals)
        assert {r.reason for r in refusals if r.kind == "quarantined"} == {"namespace_cleared"}
        # I9 for audit reads: tenant-b sees its own release and nothing of tenant-a's decisions.
        scoped = Audit(event_log, tenant="tenant-b")
        assert [d.outcome for d in await scoped.decisions()] == ["released"]
        with pytest.raises(OutOfScope):
            await scoped.decisions(A_ID.hex())
        assert keys["engine-a"]
    finally:
        await event_log.close()


def test_cli_decide_on_a_log_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_DATA_DIR", str(tmp_path))  # no sidecar on the default socket
    path = tmp_path / "log.sqlite"
    keys = anyio.run(_build_log, path)
    log = ["--log", str(path)]

    missing = runner.invoke(
        namespace_app,
        ["decide", "--from", A_ID.hex(), "--to", B_ID.hex(), "--outcome", "compatible", "--reason", "same tensors", *log],
    )
    assert missing.exit_code == 1 and "missing_evidence" in missing.stderr and "--evidence" in missing.stderr
    unknown = runner.invoke(
        namespace_app, ["decide", "--from", bytes(16).hex(), "--to", B_ID.hex(), "--outcome", "clear", "--reason", "r", *log]
    )
    assert unknown.exit_code == 1 and "unknown_namespace" in unknown.stderr
    typo = runner.invoke(
        namespace_app, ["decide", "--from", A_ID.hex(), "--to", B_ID.hex(), "--outcome", "alias", "--reason", "r", *log]
    )
    assert typo.exit_code == 2  # typer refuses the choice before anything is recorded

    cleared = runner.invoke(
        namespace_app,
        [
            "decide",
            "--from",
            A_ID.hex(),
            "--to",
            B_ID.hex(),
            "--outcome",
            "clear",
            "--reason",
            "weights changed under the same name",
            "--json",
            *log,
        ],
    )
    assert cleared.exit_code == 0, cleared.output
    answer = json.loads(cleared.stdout)
    assert answer["refused"] is False and answer["affected_keys"] == 2
    text = runner.invoke(
        namespace_app,
        [
            "decide",
            "--from",
            B_ID.hex(),
            "--to",
            A_ID.hex(),
            "--outcome",
            "compatible",
            "--reason",
            "same tensors",
            "--evidence",
            "eval-run-7",
            *log,
        ],
    )
    assert text.exit_code == 0 and "decided compatible" in text.stdout

    async def check() -> None:
        event_log = await open_log(str(path))
        try:
            ledger = await Ledger.open(event_log)
            tier = ledger.state.tiers[b.TIER]
            assert all(tier.entry(0, key).quarantined for key in keys["engine-a"])  # type: ignore[union-attr]
            assert not any(tier.entry(0, key).quarantined for key in keys["engine-b"])  # type: ignore[union-attr]
            assert isinstance(event_log, SqlEventLog)
            await sync_index(event_log)
            assert [d.outcome for d in await Audit(event_log).decisions()] == ["clear", "compatible"]
        finally:
            await event_log.close()

    anyio.run(check)


def test_cli_gc_releases_only_the_old_namespaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A last used at T0, the other tenant's at T0 + 1d, B at T0 + 10d; judged at T0 + 12d with
    --older-than 7d, A and the other tenant's are abandoned and B is not."""
    monkeypatch.setenv("KVLEDGER_DATA_DIR", str(tmp_path))
    path = tmp_path / "log.sqlite"
    keys = anyio.run(_build_log, path)
    now = str(T0 + 12 * DAY)
    log = ["--log", str(path), "--now", now]

    dry = runner.invoke(namespace_app, ["gc", "--older-than", "7d", "--dry-run", "--json", *log])
    assert dry.exit_code == 0, dry.output
    report = json.loads(dry.stdout)
    assert sorted(c["namespace_id"] for c in report["candidates"]) == sorted([A_ID.hex(), OTHER_ID.hex()])
    assert report["released"] == [] and report["older_than_seconds"] == 7 * DAY
    assert sum(map(len, anyio.run(_state_keys, path).values())) == 6, "a dry run records nothing"

    scoped = runner.invoke(namespace_app, ["gc", "--older-than", "7d", "--tenant", "tenant-b", *log])
    assert scoped.exit_code == 0 and f"released {OTHER_ID.hex()}" in scoped.stdout and A_ID.hex() not in scoped.stdout
    released = runner.invoke(namespace_app, ["gc", "--older-than", "7d", *log])
    assert released.exit_code == 0, released.output
    assert f"released {A_ID.hex()}" in released.stdout and "2 keys evicted" in released.stdout
    assert B_ID.hex() not in released.stdout
    assert anyio.run(_state_keys, path) == {B_ID: keys["engine-b"]}

    again = runner.invoke(namespace_app, ["gc", "--older-than", "7d", *log])
    assert again.exit_code == 0 and again.stdout.startswith("0 namespaces"), "a released namespace has nothing left"
    later = runner.invoke(
        namespace_app, ["gc", "--older-than", "1d", "--dry-run", "--log", str(path), "--now", str(T0 + 12 * DAY)]
    )
    assert f"would release {B_ID.hex()}" in later.stdout
    bad = runner.invoke(namespace_app, ["gc", "--older-than", "a week", *log])
    assert bad.exit_code == 2 and "duration" in bad.output


# --- through the sidecar -----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_decisions_through_the_sidecar(tmp_path: Path) -> None:
    """An operator connection records decisions; an engine may not send them; the CLI records
    through --socket; and --log refuses to write behind a sidecar on the default socket."""
    path = tmp_path / "log.sqlite"
    keys = await _build_log(path)
    socket_path = tmp_path / "kvledger.sock"
    event_log = await open_log(str(path))
    try:
        async with embedded_sidecar(event_log, socket_path) as sidecar:
            operator = OperatorClient(Address(socket_path=str(socket_path)))
            committed = await operator.execute(decide("new"), command_id="decision-1")
            assert [type(e) for e in committed.events] == [NamespaceDecided]
            retried = await operator.execute(decide("new"), command_id="decision-1")
            assert retried.duplicate and retried.first_seq == committed.first_seq
            refused = await operator.execute(decide("compatible"))
            assert [e.reason for e in refused.events if isinstance(e, Refused)] == [Reason.MISSING_EVIDENCE]
            with pytest.raises(SidecarError) as error:  # an operator sends operator commands only
                await operator.execute(ResetCache(engine_id="engine-a"))
            assert error.value.code == p.ErrorCode.WRONG_ROLE

            async with EngineClient(Address(socket_path=str(socket_path)), declaration("engine-a", A)) as engine:
                with pytest.raises(SidecarError) as error:
                    await engine.execute(decide("clear"))
                assert error.value.code == p.ErrorCode.WRONG_ROLE
                with pytest.raises(SidecarError):
                    await engine.step(1000, 1e6, [decide("clear")])

            env = {**os.environ, "KVLEDGER_DATA_DIR": str(tmp_path)}  # the sidecar is on the default socket
            cli = [sys.executable, "-c", "from coordinator.cli.namespace import namespace_app; namespace_app()"]
            behind = await anyio.run_process(
                [
                    *cli,
                    "decide",
                    "--from",
                    A_ID.hex(),
                    "--to",
                    B_ID.hex(),
                    "--outcome",
                    "clear",
                    "--reason",
                    "r",
                    "--log",
                    str(path),
                ],
                env=env,
                cwd=ROOT,
                check=False,
            )
            assert behind.returncode == 1 and b"a sidecar answers" in behind.stderr
            cleared = await anyio.run_process(
                [
                    *cli,
                    "decide",
                    "--from",
                    A_ID.hex(),
                    "--to",
                    B_ID.hex(),
                    "--outcome",
                    "clear",
                    "--reason",
                    "r",
                    "--socket",
                    str(socket_path),
                    "--json",
                ],
                env=env,
                cwd=ROOT,
                check=False,
            )
            assert cleared.returncode == 0, cleared.stderr.decode()
            assert json.loads(cleared.stdout)["affected_keys"] == 2
            tier = sidecar.ledger.state.tiers[b.TIER]
            assert all(tier.entry(0, key).quarantined for key in keys["engine-a"])  # type: ignore[union-attr]
    finally:
        await event_log.close()


def test_the_cli_runs_as_a_subprocess_module() -> None:
    """The sub-app imports on its own (the lead registers it in coordinator/cli.py)."""
    out = subprocess.run(
        [sys.executable, "-c", "from coordinator.cli.namespace import namespace_app; namespace_app()", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0 and "decide" in out.stdout and "gc" in out.stdout


# --- a mistyped --log, odd times ---------------------------------------------------------------------------


def test_cli_never_creates_a_log_where_none_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """decide and gc on a mistyped --log: an error naming the path (exit 1, as the audit commands
    answer a missing log), and no new, empty log left there."""
    monkeypatch.setenv("KVLEDGER_DATA_DIR", str(tmp_path))  # no sidecar on the default socket
    typo = tmp_path / "typo" / "nolog.sqlite"
    for args in (
        ["decide", "--from", A_ID.hex(), "--to", B_ID.hex(), "--outcome", "new", "--reason", "r"],
        ["gc", "--older-than", "1d"],
        ["gc", "--older-than", "1d", "--dry-run"],
    ):
        result = runner.invoke(namespace_app, [*args, "--log", str(typo)])
        assert result.exit_code == 1, (args, result.output)
        assert f"no log at {typo}" in result.stderr and "Traceback" not in result.output
        assert len(result.stderr.strip().splitlines()) == 1
        assert not typo.exists() and not typo.parent.exists(), "no log (nor its directory) was created"
    # Nor on the default log, when there is none.
    result = runner.invoke(
        namespace_app, ["decide", "--from", A_ID.hex(), "--to", B_ID.hex(), "--outcome", "new", "--reason", "r"]
    )
    assert result.exit_code == 1 and "no log at" in result.stderr, result.output
    assert not list(tmp_path.glob("*.sqlite*"))


@pytest.mark.parametrize("now", ["-1e12", "1e300", "nan", "inf", "0001-01-01T00:00:00+01:00"])
def test_cli_gc_refuses_a_time_no_datetime_can_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, now: str) -> None:
    monkeypatch.setenv("KVLEDGER_DATA_DIR", str(tmp_path))
    path = tmp_path / "log.sqlite"
    anyio.run(_build_log, path)
    result = runner.invoke(namespace_app, ["gc", "--older-than", "1d", "--now", now, "--log", str(path)])
    assert result.exit_code == 2, result.output
    assert "--now" in result.output and "expected a" in result.output and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_a_duration_too_long_for_a_float_is_refused() -> None:
    with pytest.raises(ValueError, match="too long"):
        parse_duration("9" * 400 + "w")
