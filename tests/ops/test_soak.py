"""The soak (ops/soak.py) in its CI size: a real `kvledger serve` subprocess SIGKILLed twice and a
worker killed once, early and deterministically, under the mixed workload; every check must pass
and the faults must really have happened. Then the soak's own machinery: regrouping a retried
step on a real sidecar, and its checks failing where they must (a lost or doubled commit, an
unexplained refusal, memory that grows)."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
import torch
from rich.console import Console

from coordinator.client import Address, EngineClient
from coordinator.core.commands import (
    AllocateBlocks,
    AnyCommand,
    FinishOwner,
    FreeEncoderEntry,
    MarkComputed,
    ReportRank,
    StartOwner,
    StartStore,
)
from coordinator.sidecar.embedded import embedded_sidecar
from events import (
    BlockRef,
    BlocksAllocated,
    Event,
    KeyEvicted,
    NoticeDropped,
    OwnerStarted,
    Refused,
    StepBegan,
    StepEnded,
    StoreJobStarted,
    TierSpec,
)
from events.log import AppendResult, StoredEvent, open_log
from gpu.checksum import checksum
from ops import soak
from ops.soak_checks import (
    Ack,
    LogFacts,
    RegroupError,
    RssSample,
    check_commits,
    check_memory,
    check_refusals,
    regroup,
    rss_segments,
)
from tests.kit import builders as b
from tests.kit.sidecar import declaration


@pytest.mark.timeout(150)
def test_soak_with_two_serve_kills_and_a_worker_kill_passes_every_check(tmp_path: Path) -> None:
    options = soak.SoakOptions(
        seconds=20,
        engines=2,
        seed=11,
        directory=tmp_path / "run",
        serve_kill_every=0,
        worker_kill_every=0,
        forced_serve_kills=2,
        forced_worker_kills=1,
        first_fault=2.0,
        steps_between_kills=3,
        warmup=3.0,
        rss_every=0.25,
    )
    report = soak.run_soak(options)
    out = io.StringIO()
    soak.print_report(report, Console(file=out, width=200))
    failed = [check for check in report.checks if not check.passed]
    assert not failed, out.getvalue()
    assert [check.name for check in report.checks] == [
        "no committed event lost or duplicated",
        "kvledger verify finds nothing",
        "zero wrong-KV reads",
        "serve resident memory flat after warm-up",
        "refusals only of kinds the workload or the faults explain",
        "engines and workers rode through",
    ]
    # The faults happened, and work went on after them: the checks above were not vacuous.
    assert report.serve_kills == 2 and report.serve_restarts == 2, out.getvalue()
    assert report.worker_kills == 1
    assert report.steps_after_restart > 0 and report.reconnects >= 2 * options.engines
    assert report.loads_checked > 0 and report.hits > 0
    assert {segment.segment for segment in report.segments} == {0, 1, 2}
    assert any(segment.judged for segment in report.segments)
    assert "every check passed" in out.getvalue() and "FAIL" not in out.getvalue()


@pytest.mark.timeout(180)
def test_the_kafka_soak_rides_through_a_broker_outage_a_serve_kill_and_a_worker_kill(tmp_path: Path) -> None:
    """--log kafka: the soak starts a Tansu broker and logs to a topic there. The broker stops
    answering for a while (SIGSTOP: appends time out, the sidecar retries), the serve process
    and a `kvledger worker` process are SIGKILLed; every check passes, the memory check allowing
    the Kafka log's own in-memory copy of its events."""
    from tests.conftest import REQUIRE_KAFKA, unavailable
    from tests.kit.kafka import BrokerUnavailable, broker_binary

    try:
        broker_binary()
    except BrokerUnavailable as missing:
        unavailable(f"no Kafka broker for the soak: {missing}", REQUIRE_KAFKA, "KVLEDGER_REQUIRE_KAFKA")
    options = soak.SoakOptions(
        seconds=20,
        engines=2,
        seed=12,
        log=soak.KAFKA,
        directory=tmp_path / "run",
        serve_kill_every=0,
        worker_kill_every=0,
        broker_pause_every=0,
        forced_serve_kills=1,
        forced_worker_kills=1,
        forced_broker_pauses=1,
        first_fault=2.0,
        steps_between_kills=3,
        warmup=3.0,
        rss_every=0.25,
    )
    report = soak.run_soak(options)
    out = io.StringIO()
    soak.print_report(report, Console(file=out, width=200))
    assert not [check for check in report.checks if not check.passed], out.getvalue()
    assert report.log.startswith("kafka://") and "each event the Kafka log appended" in out.getvalue()
    assert (report.serve_kills, report.worker_kills, report.broker_pauses) == (1, 1, 1), out.getvalue()
    assert report.steps_after_restart > 0 and report.loads_checked > 0 and report.wrong_reads == 0


# --- a retried step, regrouped per command ------------------------------------------------------------


@pytest.mark.anyio
async def test_a_retried_step_is_regrouped_into_the_first_replys_groups(tmp_path: Path) -> None:
    """On a real sidecar: a step of accepted and refused commands (a store that evicts, a
    finish that releases, a refused store and allocation, a dropped notice), sent again with its
    command id, comes back in one group; regroup splits it exactly as the first reply was."""
    engine_id = "pod-a"
    tier = TierSpec(name=b.TIER, num_slots=2, bytes_per_slot=64)
    event_log = await open_log(str(tmp_path / "log.sqlite"))
    socket = tmp_path / "s.sock"
    try:
        async with embedded_sidecar(event_log, socket):
            async with EngineClient(
                Address(socket_path=str(socket)), declaration(engine_id, num_blocks=8), tiers=[tier]
            ) as client:
                started = await client.step(1, 0.1, [StartOwner(engine_id=engine_id, req_id=f"r{i}") for i in (1, 2)])
                first, second = (e.owner_id for group in started.results for e in group if isinstance(e, OwnerStarted))
                allocated = await client.step(
                    2, 0.2, [AllocateBlocks(engine_id=engine_id, owner_id=owner, pool_id=0, count=2) for owner in (first, second)]
                )
                blocks: list[list[BlockRef]] = [
                    e.blocks for group in allocated.results for e in group if isinstance(e, BlocksAllocated)
                ]
                stored = await client.step(
                    3,
                    0.3,
                    [
                        MarkComputed(engine_id=engine_id, owner_id=first, blocks=blocks[0], token_ids=list(range(2 * b.BLOCK))),
                        StartStore(engine_id=engine_id, tier=b.TIER, blocks=blocks[0]),
                    ],
                )
                job = next(e for e in stored.results[1] if isinstance(e, StoreJobStarted))
                sums = [checksum(torch.zeros(64, dtype=torch.uint8))] * len(job.items)
                for rank in (0, 1):
                    await client.report(ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=sums))
                commands: list[AnyCommand] = [
                    MarkComputed(
                        engine_id=engine_id, owner_id=second, blocks=blocks[1], token_ids=list(range(100, 100 + 2 * b.BLOCK))
                    ),
                    StartStore(engine_id=engine_id, tier=b.TIER, blocks=blocks[1]),  # evicts the first owner's keys
                    StartStore(engine_id=engine_id, tier=b.TIER, blocks=blocks[0]),  # every slot pinned: refused
                    FinishOwner(engine_id=engine_id, owner_id=first),
                    AllocateBlocks(engine_id=engine_id, owner_id=second, pool_id=0, count=50),  # refused
                    FreeEncoderEntry(engine_id=engine_id, entry_id="none"),  # a notice: dropped
                ]
                original = await client.step(4, 0.4, commands, command_id="step-4")
                retried = await client.step(4, 0.4, commands, command_id="step-4")
    finally:
        await event_log.close()
    assert not original.duplicate and retried.duplicate and len(retried.results) == 1
    kinds = [[type(e) for e in group] for group in original.results]
    assert KeyEvicted in kinds[1] and kinds[2] == [Refused] and kinds[4] == [Refused] and kinds[5] == [NoticeDropped]
    assert regroup(commands, retried.results[0]) == original.results
    assert regroup(commands, [e for group in original.results for e in group]) == original.results
    with pytest.raises(RegroupError):
        regroup(commands, retried.results[0][:-1])
    with pytest.raises(RegroupError):
        regroup(commands[:-1], retried.results[0])


# --- the checks fail where they must ------------------------------------------------------------------


def _facts(events: list[tuple[str, Event]]) -> LogFacts:
    """A log of (stream, event), folded as the soak folds the real one."""
    facts = LogFacts()
    versions: dict[str, int] = {}
    for seq, (stream, event) in enumerate(events, 1):
        versions[stream] = versions.get(stream, 0) + 1
        facts.feed(StoredEvent(seq, f"id-{seq}", stream, versions[stream], 0, 0.0, "x", 1, b""), event)
    return facts


def _step(engine: str, step: int) -> list[tuple[str, Event]]:
    return [
        (f"engine/{engine}", StepBegan(engine_id=engine, step=step, clock=0.0)),
        (f"engine/{engine}", StepEnded(engine_id=engine, step=step, freed_blocks=[], freed_encoder_entries=[], removed_keys=[])),
    ]


def _ack(step: int, first: int) -> Ack:
    return Ack(command_id=f"e/step-{step}", kind="step", engine_id="e", step=step, first_seq=first, last_seq=first + 1, segment=0)


def _found(*acks: Ack) -> dict[str, AppendResult]:
    return {
        a.command_id: AppendResult(
            stream_id="engine/e", first_seq=a.first_seq, last_seq=a.last_seq, stream_version=a.last_seq, duplicate=True
        )
        for a in acks
    }


def test_commit_check_passes_a_clean_log_and_fails_a_lost_a_doubled_or_a_moved_step() -> None:
    acks = [_ack(1, 1), _ack(2, 3)]
    clean = _facts(_step("e", 1) + _step("e", 2))
    assert check_commits(acks, _found(*acks), clean, head=4).passed
    lost = check_commits(acks, _found(acks[0]), _facts(_step("e", 1)), head=2)
    assert not lost.passed and "not in the log (lost)" in lost.detail
    doubled = check_commits(acks, _found(*acks), _facts(_step("e", 1) + _step("e", 2) + _step("e", 2)), head=6)
    assert not doubled.passed and "more than once" in doubled.detail
    moved = check_commits([_ack(1, 1), _ack(2, 1)], _found(_ack(1, 1), _ack(2, 3)), clean, head=4)
    assert not moved.passed and "is at (3, 4)" in moved.detail
    unacknowledged = check_commits(acks[:1], _found(acks[0]), clean, head=4)
    assert not unacknowledged.passed and "no engine was told of" in unacknowledged.detail


def test_refusal_check_accepts_only_what_the_workload_or_a_fault_that_happened_explains() -> None:
    assert check_refusals({"Refused:pool_exhausted": 3}, []).passed
    assert not check_refusals({"NoticeDropped:stale_job": 1}, []).passed  # no worker was killed
    assert check_refusals({"NoticeDropped:stale_job": 1}, ["worker kill"]).passed
    unexplained = check_refusals({"JobFailed:checksum_mismatch": 1, "Refused:pool_exhausted": 1}, ["serve kill", "worker kill"])
    assert not unexplained.passed and "JobFailed:checksum_mismatch x1" in unexplained.detail


def test_on_a_log_that_keeps_its_events_in_memory_growth_is_allowed_per_event_appended_and_no_more() -> None:
    """The Kafka soak's memory check: growth up to bytes_per_event for each event appended over
    the judged window passes; the same growth with fewer events appended, or more growth, fails."""
    # 30 MB over the window while 100,000 events were appended: 300 B an event.
    kafka = [RssSample(0, t / 2, 90.0 + t * 0.5, events=t * 1_700) for t in range(80)]
    [allowed] = rss_segments(kafka, warmup=10.0, limit_mb=8.0, limit_pct=5.0, bytes_per_event=512)
    [without] = rss_segments(kafka, warmup=10.0, limit_mb=8.0, limit_pct=5.0)
    [too_few] = rss_segments(
        [RssSample(0, s.since_start, s.mb, events=s.events // 10) for s in kafka],
        warmup=10.0,
        limit_mb=8.0,
        limit_pct=5.0,
        bytes_per_event=512,
    )
    assert allowed.judged and allowed.flat and allowed.allowed_mb > allowed.growth_mb > 8.0
    assert not without.flat and not too_few.flat
    check = check_memory([allowed], warmup=10.0, limit_mb=8.0, limit_pct=5.0, allowance="512 B an event")
    assert check.passed and "allowed beyond the limit there" in check.detail


def test_memory_check_judges_segments_after_warm_up_and_fails_growth() -> None:
    flat = [RssSample(0, t / 2, 90.0 + (t % 3) * 0.1) for t in range(60)]
    growing = [RssSample(1, t / 2, 90.0 + t * 0.5) for t in range(60)]
    short = [RssSample(2, t / 2, 90.0 + t * 5) for t in range(6)]
    segments = rss_segments(flat + growing + short, warmup=5, limit_mb=8, limit_pct=5)
    assert [(s.judged, s.flat) for s in segments] == [(True, True), (True, False), (False, True)]
    assert segments[1].growth_mb > 8
    assert not check_memory(segments, warmup=5, limit_mb=8, limit_pct=5).passed
    assert check_memory(segments[::2], warmup=5, limit_mb=8, limit_pct=5).passed
    assert not check_memory(segments[2:], warmup=5, limit_mb=8, limit_pct=5).passed  # nothing judged


def test_fault_plan_is_seeded_and_puts_forced_kills_first() -> None:
    options = soak.SoakOptions(seconds=100, engines=3, forced_serve_kills=2, forced_worker_kills=1)
    plan = soak.plan_faults(options, random.Random(5))
    assert plan == soak.plan_faults(options, random.Random(5))
    assert [f.kind for f in plan[:3]] == ["worker", "serve", "serve"]
    assert all(f.at < 75 for f in plan if f.kind == "serve")  # the quiet tail: no serve kill in the last quarter
    assert all(0 <= f.engine < 3 and 0 <= f.rank < 2 for f in plan)
