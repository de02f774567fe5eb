"""The sidecar's committer (coordinator/sidecar/committer.py) with several groups in flight on a
real Kafka log: answers in the order the groups were decided, each only once its append is in
the log; a group the log refuses in the middle fails its own steps, and the groups behind it,
which the log refused for it, are decided again, in order; no step is lost or taken twice.

Each test has a Tansu broker of its own behind a proxy that delays every byte (tests/kit/
tcp_proxy.py, DELAY each way; the broker advertises the proxy, so every connection goes through
it): a round trip takes 2 x DELAY, and groups decided meanwhile are certainly in flight together,
as they are against a broker across a network. The committer, the ledger and the log are real;
one test injects a fault at the log's boundary (an append carrying an event id of the append
before it: the writer's check does not look at appends in flight, so the fold refuses it)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
import pytest

from coordinator.core.commands import (
    AllocateBlocks,
    AnyCommand,
    DeclareTier,
    FinishOwner,
    MarkComputed,
    StartOwner,
    StartStore,
)
from coordinator.core.routing import decisions_for
from coordinator.core.state import state_digest
from coordinator.ledger.ledger import Commit, Ledger, Step, StepCommit
from coordinator.ledger.recovery import replay
from coordinator.sidecar.committer import Committer
from coordinator.sidecar.hub import DecisionHub
from coordinator.sidecar.metrics import SidecarMetrics
from events import BlocksAllocated, EventCodec, OwnerStarted, Refused, StepBegan, TierSpec
from events.log import (
    AppendBatch,
    AppendInFlight,
    AppendRejected,
    AppendResult,
    EventLog,
    KafkaEventLog,
    open_log,
)
from tests.conftest import KAFKA_FETCH_WAIT_MS, REQUIRE_KAFKA, unavailable
from tests.kit import builders as b
from tests.kit.kafka import BrokerUnavailable, KafkaBroker
from tests.kit.sidecar import TIER_SPEC, declaration
from tests.kit.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

DELAY = 0.03
"""Seconds each way between the log and its broker: a 60 ms round trip."""
ENGINES = ["pod-a", "pod-b", "pod-c", "pod-d"]


@pytest.fixture
def far_broker() -> Iterator[KafkaBroker]:
    """A broker of this test's own, reached through a proxy that delays every byte by DELAY."""
    proxy = TcpProxy(("127.0.0.1", 0), delay=DELAY)
    try:
        try:
            broker = KafkaBroker.start(advertised_port=proxy.port)
        except BrokerUnavailable as missing:
            unavailable(f"no Kafka broker for the tests: {missing}", REQUIRE_KAFKA, "KVLEDGER_REQUIRE_KAFKA")
        proxy.target = ("127.0.0.1", broker.port)
        try:
            yield broker
        finally:
            broker.stop()
    finally:
        proxy.close()


@dataclass
class Committed:
    """A committer on a ledger on the far broker's log, with what it answered, in order."""

    ledger: Ledger
    committer: Committer
    answered: list[tuple[str, StepCommit | Commit | BaseException]] = field(default_factory=list)
    most_in_flight: int = 0
    """The most groups whose appends were in flight at once (Ledger.in_flight, looked at every ms)."""

    async def submit(self, engine: str, step: int, command_id: str) -> None:
        tx = Step(
            engine_id=engine,
            step=step,
            clock=float(step),
            commands=[StartOwner(engine_id=engine, req_id=f"{engine}-{step}")],
            command_id=command_id,
        )
        try:
            result: StepCommit | Commit | BaseException = await self.committer.submit(tx)
        except Exception as error:  # noqa: BLE001 - the test looks at which steps failed, and with what
            result = error
        self.answered.append((command_id, result))


@pytest.fixture
async def committed(far_broker: KafkaBroker, tmp_path: Path) -> AsyncIterator[Committed]:
    event_log = await open_log(far_broker.url(state=tmp_path / "state.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS))
    assert isinstance(event_log, KafkaEventLog)
    try:
        ledger = await Ledger.open(event_log)
        await ledger.execute(DeclareTier(spec=TIER_SPEC))
        for engine in ENGINES:
            await ledger.execute(declaration(engine))
        yield Committed(ledger, committer_on(ledger, appends_in_flight=4))
    finally:
        await event_log.close()


def committer_on(ledger: Ledger, appends_in_flight: int) -> Committer:
    """One transaction a group (max_group=1): each step is a group, and an append, of its own."""
    hub = DecisionHub(ledger.log, ledger.codec, ledger.last_seq, 100)
    metrics = SidecarMetrics(lambda: ledger.state)
    return Committer(ledger, hub, metrics, max_group=1, appends_in_flight=appends_in_flight)


async def run(committed: Committed, submissions: Sequence[tuple[str, int, str]]) -> None:
    """Submit every step (in this order, each queued before the next), run the committer until
    all are answered, and note the most groups in flight at once meanwhile."""
    ledger, committer = committed.ledger, committed.committer
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(committer.run)
            for engine, step, command_id in submissions:
                tasks.start_soon(committed.submit, engine, step, command_id)
                await anyio.sleep(0)  # queued in this order
            while len(committed.answered) < len(submissions):
                committed.most_in_flight = max(committed.most_in_flight, ledger.in_flight)
                await anyio.sleep(0.001)
            committer.close()


def first_seq(result: StepCommit | Commit | BaseException) -> int:
    assert isinstance(result, StepCommit), result
    return result.commit.first_seq


async def steps_in_log(event_log: EventLog) -> list[tuple[str, int]]:
    """(engine stream, step) of every StepBegan in the log, in log order."""
    codec = EventCodec()
    stored = await event_log.read(0, 1_000_000)
    began = [codec.decode(s.event_type, s.schema_version, s.payload) for s in stored if s.event_type == "step_began"]
    return [(event.engine_id, event.step) for event in began if isinstance(event, StepBegan)]


async def test_several_groups_travel_at_once_and_are_answered_in_the_order_they_were_decided(
    committed: Committed,
) -> None:
    """Four engines' steps, each its own group: up to four appends travel together (each group is
    decided and handed to the log without waiting for the round trips before it); every step is
    answered after its own append, in the order the groups were decided (their order in the log),
    and the log holds each step once, each engine's in its order."""
    submissions = [(engine, step, f"{engine}-{step}") for step in (1, 2, 3) for engine in ENGINES]
    await run(committed, submissions)
    assert committed.most_in_flight >= 3, committed.most_in_flight
    answers = [first_seq(result) for _, result in committed.answered]
    assert answers == sorted(answers), "a step was answered before one appended before it"
    assert [command for command, _ in committed.answered] == [command for _, _, command in submissions]
    assert await steps_in_log(committed.ledger.log) == [(engine, step) for engine, step, _ in submissions]
    full, _ = await replay(committed.ledger.log, EventCodec())
    async with committed.ledger.committed() as live:
        assert state_digest(full) == state_digest(live)


async def test_with_one_append_in_flight_the_same_steps_wait_for_each_round_trip(committed: Committed) -> None:
    """The same steps with appends_in_flight=1 (what a SQL log gets): never more than the group
    travelling and the one decided on it, and slower by about a round trip a group."""
    committed.committer = committer_on(committed.ledger, appends_in_flight=1)
    submissions = [(engine, step, f"{engine}-{step}") for step in (1, 2) for engine in ENGINES]
    started = time.perf_counter()
    await run(committed, submissions)
    one_at_a_time = time.perf_counter() - started
    assert committed.most_in_flight <= 2, committed.most_in_flight
    assert one_at_a_time >= len(submissions) * 2 * DELAY * 0.9, one_at_a_time  # a round trip per group at least
    assert await steps_in_log(committed.ledger.log) == [(engine, step) for engine, step, _ in submissions]


async def test_a_group_the_log_refuses_in_the_middle_fails_its_steps_and_the_groups_behind_it_are_decided_again(
    committed: Committed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three groups travel together; the log's fold refuses the second (it repeats an event id of
    the first: injected at the log's boundary). The first is committed and answered; the second's
    step fails with the refusal; the third, which the fold refused because it followed the second
    (rule 0's `follows`), is not answered from that append: it is decided again on the log as it
    is, committed once, and answered after the others, in order."""
    event_log = committed.ledger.log
    assert isinstance(event_log, KafkaEventLog)
    queue_append = event_log.queue_append
    appends: list[list[AppendBatch]] = []
    verdicts: list[str] = []

    async def second_repeats_an_id_of_the_first(
        batches: Sequence[AppendBatch], *, expected_head: int | None = None
    ) -> AppendInFlight:
        batches = list(batches)
        if len(appends) == 1:
            repeated = appends[0][0].events[0].event_id
            [batch] = batches
            events = [msgspec.structs.replace(batch.events[0], event_id=repeated), *batch.events[1:]]
            batches = [msgspec.structs.replace(batch, events=events)]
        appends.append(batches)
        return Judged(await queue_append(batches, expected_head=expected_head), verdicts)

    monkeypatch.setattr(event_log, "queue_append", second_repeats_an_id_of_the_first)
    submissions = [("pod-a", 1, "a-1"), ("pod-b", 1, "b-1"), ("pod-c", 1, "c-1")]
    await run(committed, submissions)

    assert committed.most_in_flight >= 3, committed.most_in_flight
    # Queued, all three, before any verdict: the fold refused the second and the third.
    assert verdicts[:3] == ["accepted", "AppendRejected", "HeadMoved"], verdicts
    assert verdicts[3:] == ["accepted"], verdicts  # the third, decided again
    answered = dict(committed.answered)
    assert [command for command, _ in committed.answered] == ["a-1", "b-1", "c-1"]
    assert isinstance(answered["b-1"], AppendRejected), answered["b-1"]
    first, third = answered["a-1"], answered["c-1"]
    assert isinstance(first, StepCommit) and isinstance(third, StepCommit)
    assert not first.commit.duplicate and not third.commit.duplicate
    assert first.commit.last_seq + 1 == third.commit.first_seq  # the third right after the first
    assert await steps_in_log(event_log) == [("pod-a", 1), ("pod-c", 1)]
    full, _ = await replay(event_log, EventCodec())
    async with committed.ledger.committed() as live:
        assert state_digest(full) == state_digest(live)
        assert sorted(owner.req_id for owner in live.owners.values()) == ["pod-a-1", "pod-c-1"]


async def test_every_decision_reaches_its_workers_once_in_log_order_with_groups_in_flight(committed: Committed) -> None:
    """Each engine's owners given blocks one step at a time; then every engine's store steps at
    once, each its own group, several travelling (and landing) together: a worker subscribed
    before gets each store decision of its engine exactly once, in log order. (A group is
    published when it is answered, up to its own last sequence: published up to the log's head,
    a group behind it that landed first would then be taken for published already, and lost.)"""
    ledger, committer = committed.ledger, committed.committer
    hub = committer.hub
    numbers = dict.fromkeys(ENGINES, 0)
    owners = 3

    async def step(engine: str, commands: list[AnyCommand]) -> StepCommit:
        numbers[engine] += 1
        number = numbers[engine]
        tx = Step(engine_id=engine, step=number, clock=float(number), commands=commands, command_id=f"{engine}-{number}")
        result = await committer.submit(tx)
        assert isinstance(result, StepCommit) and not any(isinstance(e, Refused) for r in result.results for e in r)
        return result

    async def allocate(engine: str, index: int) -> StoreStep:
        started = await step(engine, [StartOwner(engine_id=engine, req_id=f"{engine}-r{index}")])
        owner = next(e for e in started.results[0] if isinstance(e, OwnerStarted)).owner_id
        allocated = await step(engine, [AllocateBlocks(engine_id=engine, owner_id=owner, pool_id=0, count=2)])
        blocks = next(e for e in allocated.results[0] if isinstance(e, BlocksAllocated)).blocks
        tokens = [hash((engine, index, i)) % 50_000 for i in range(2 * b.BLOCK)]
        return [
            MarkComputed(engine_id=engine, owner_id=owner, blocks=blocks, token_ids=tokens),
            StartStore(engine_id=engine, tier=b.TIER, blocks=blocks),
            FinishOwner(engine_id=engine, owner_id=owner),
        ]

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(committer.run)
            submissions = [(engine, await allocate(engine, index)) for index in range(owners) for engine in ENGINES]
            subscriptions = {engine: hub.register(engine, 0, ledger.last_seq) for engine in ENGINES}
            answered: list[int] = []

            async def store(engine: str, commands: StoreStep) -> None:
                answered.append((await step(engine, commands)).commit.first_seq)

            for engine, commands in submissions:
                tasks.start_soon(store, engine, commands)
                await anyio.sleep(0)  # queued in this order
            while len(answered) < len(submissions):
                committed.most_in_flight = max(committed.most_in_flight, ledger.in_flight)
                await anyio.sleep(0.001)
            committer.close()
    assert committed.most_in_flight >= 3, committed.most_in_flight
    assert answered == sorted(answered)
    codec = EventCodec()
    stored = await ledger.log.read(0, 1_000_000)
    for engine, subscription in subscriptions.items():
        expected = [
            decision.seq
            for s in stored
            for decision in decisions_for([codec.decode(s.event_type, s.schema_version, s.payload)], s.global_seq, engine, 0)
        ]
        assert len(expected) == owners, expected
        with anyio.fail_after(5):
            got = [decision.seq for decision in await subscription.live()]
        assert got == expected, (engine, got, expected)


StoreStep = list[AnyCommand]


class Judged:
    """An append in flight whose verdict is noted: 'accepted' or the error's type."""

    def __init__(self, appending: AppendInFlight, verdicts: list[str]) -> None:
        self.appending, self.verdicts = appending, verdicts

    async def results(self) -> list[AppendResult]:
        try:
            results = await self.appending.results()
        except Exception as error:
            self.verdicts.append(type(error).__name__)
            raise
        self.verdicts.append("accepted")
        return results


async def test_groups_behind_one_another_writer_overtook_are_decided_again_in_their_order(
    committed: Committed,
) -> None:
    """Another sidecar on the same log appends (declares a tier) just before three groups of ours
    travel together: the first names a head that moved (HeadMoved), the two behind it are refused
    for following it. All three go back in line, in their order, are decided again on top of the
    other sidecar's append, and are committed once each, in that order."""
    event_log = committed.ledger.log
    other_log = await open_log(event_log.url.replace("state.sqlite", "other-state.sqlite"))
    assert isinstance(other_log, KafkaEventLog)
    try:
        other = await Ledger.open(other_log)
        await other.execute(DeclareTier(spec=tier("second")))  # its claim, and an append
        assert await committed.ledger.catch_up() > 0
        moved = committed.committer.metrics.head_moved
        before = moved._value.get()  # noqa: SLF001 - a prometheus counter's value

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(other.execute, DeclareTier(spec=tier("third")))
            with anyio.fail_after(10):  # its stream claimed, its append produced: at the broker before ours
                while not other_log._kafka_writer._pending() or other_log._kafka_writer._outbox:  # noqa: SLF001
                    await anyio.sleep(0.001)
            await anyio.sleep(DELAY / 6)
            await run(committed, [("pod-a", 1, "a-1"), ("pod-b", 1, "b-1"), ("pod-c", 1, "c-1")])
    finally:
        await other_log.close()
    assert committed.most_in_flight >= 3, committed.most_in_flight
    assert moved._value.get() == before + 1  # noqa: SLF001 - the first group, once; the others were superseded
    assert [command for command, _ in committed.answered] == ["a-1", "b-1", "c-1"]
    answers = [first_seq(result) for _, result in committed.answered]
    assert answers == sorted(answers), "the groups put back in line lost their order"
    assert await steps_in_log(event_log) == [("pod-a", 1), ("pod-b", 1), ("pod-c", 1)]
    stored = await event_log.read(0, 1_000_000)
    third = [s.global_seq for s in stored if s.stream_id == "tier/third"]
    assert third and third[-1] < answers[0], (third, answers)


def tier(name: str) -> TierSpec:
    return TierSpec(name=name, num_slots=16, bytes_per_slot=64)
