"""The committer's leader path (coordinator/sidecar/committer.py, `_lead`) on a real SQL log: a
step that finds the committer idle is decided, appended and answered in its submitter's own task;
what comes while that group is appended is decided on top of it by the committer and answered
after it, in the log's order; a led group whose append fails fails its own step only, and the
group decided on top of it is decided again; a drain waits for a led group.

The committer, the ledger and the log are real. The only thing added is at the log's boundary:
an append that is held (or refused) until the test lets it go, and a note of the task each
append ran in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import anyio
import pytest

from coordinator.core.commands import StartOwner
from coordinator.core.state import state_digest
from coordinator.ledger.ledger import Commit, Ledger, Step, StepCommit
from coordinator.ledger.recovery import replay
from coordinator.sidecar.committer import Committer
from coordinator.sidecar.hub import DecisionHub
from coordinator.sidecar.metrics import SidecarMetrics
from events import EventCodec, StepBegan
from events.log import AppendBatch, AppendRejected, AppendResult, EventLog
from tests.kit.sidecar import TIER_SPEC, declaration

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ENGINES = ["pod-a", "pod-b", "pod-c"]


@dataclass
class Held:
    """The log's appends, as they come: the task each ran in, and, while `gate` is set up, each
    held there until the test opens it (or refused, with `refuse` set)."""

    log: EventLog
    tasks: list[int] = field(default_factory=list)
    gate: anyio.Event | None = None
    arrived: anyio.Event = field(default_factory=anyio.Event)
    refuse: bool = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        append = self.log.append

        async def noted(batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
            self.tasks.append(anyio.get_current_task().id)
            gate = self.gate
            if gate is not None:
                self.gate = None  # only the first append after the gate is set up waits
                self.arrived.set()
                await gate.wait()
                if self.refuse:
                    self.refuse = False
                    raise AppendRejected("refused by the test")
            return await append(batches, expected_head=expected_head)

        monkeypatch.setattr(self.log, "append", noted)


@pytest.fixture
async def ledger(event_log: EventLog) -> AsyncIterator[Ledger]:
    ledger = await Ledger.open(event_log)
    from coordinator.core.commands import DeclareTier

    await ledger.execute(DeclareTier(spec=TIER_SPEC))
    for engine in ENGINES:
        await ledger.execute(declaration(engine))
    yield ledger


def committer_on(ledger: Ledger) -> Committer:
    hub = DecisionHub(ledger.log, ledger.codec, ledger.last_seq, 100)
    return Committer(ledger, hub, SidecarMetrics(lambda: ledger.state))


def step(engine: str, number: int) -> Step:
    return Step(
        engine_id=engine,
        step=number,
        clock=float(number),
        commands=[StartOwner(engine_id=engine, req_id=f"{engine}-{number}")],
        command_id=f"{engine}-{number}",
    )


async def parked(committer: Committer) -> None:
    """Until the committer's task waits with nothing queued or in flight (it is then idle)."""
    with anyio.fail_after(5):
        while not committer._idle():
            await anyio.sleep(0.001)


async def steps_in_log(event_log: EventLog) -> list[tuple[str, int]]:
    codec = EventCodec()
    stored = await event_log.read(0, 1_000_000)
    began = [codec.decode(s.event_type, s.schema_version, s.payload) for s in stored if s.event_type == "step_began"]
    return [(event.engine_id, event.step) for event in began if isinstance(event, StepBegan)]


async def same_state_as_the_log(ledger: Ledger) -> None:
    full, _ = await replay(ledger.log, EventCodec())
    async with ledger.committed() as live:
        assert state_digest(full) == state_digest(live)


async def test_a_step_that_finds_the_committer_idle_is_appended_and_answered_in_its_own_task(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = Held(ledger.log)
    held.install(monkeypatch)
    committer = committer_on(ledger)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(committer.run)
        for number in (1, 2, 3):
            await parked(committer)
            result = await committer.submit(step("pod-a", number))
            assert isinstance(result, StepCommit) and not result.commit.duplicate
            assert await ledger.log.head() >= result.commit.last_seq  # answered once in the log
            assert held.tasks[-1] == anyio.get_current_task().id, "the idle committer's group was appended in another task"
        committer.close()
    assert await steps_in_log(ledger.log) == [("pod-a", 1), ("pod-a", 2), ("pod-a", 3)]
    await same_state_as_the_log(ledger)


async def test_what_comes_while_a_led_group_is_appended_is_decided_on_top_of_it_and_answered_after_it(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = Held(ledger.log, gate=anyio.Event())
    held.install(monkeypatch)
    gate = held.gate
    assert gate is not None
    committer = committer_on(ledger)
    answered: list[tuple[str, StepCommit | Commit]] = []
    most_in_flight = 0

    async def submit(engine: str, number: int) -> None:
        answered.append((engine, await committer.submit(step(engine, number))))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(committer.run)
        await parked(committer)
        tasks.start_soon(submit, "pod-a", 1)  # leads: its append is held
        with anyio.fail_after(5):
            await held.arrived.wait()
        leader = held.tasks[0]
        tasks.start_soon(submit, "pod-b", 1)
        tasks.start_soon(submit, "pod-c", 1)
        try:
            with anyio.fail_after(5):
                while ledger.in_flight < 2:  # the committer decided on top of the held group
                    await anyio.sleep(0.001)
            most_in_flight = ledger.in_flight
            early = list(answered)
        finally:
            gate.set()  # before any assertion: the held task is shielded and would wait for ever
        assert not early, "a step was answered before the group it was decided on was in the log"
        with anyio.fail_after(5):
            while len(answered) < 3:
                await anyio.sleep(0.001)
        committer.close()
    assert most_in_flight == 2  # the led group, and one group of the two that came, decided on it
    assert held.tasks[1] != leader, "the group decided on top of the led one was appended by its leader"
    assert answered[0][0] == "pod-a", answered
    seqs = [result.commit.first_seq for _, result in answered if isinstance(result, StepCommit)]
    assert len(seqs) == 3 and seqs[0] == min(seqs), "the led group was not answered first"
    logged = await steps_in_log(ledger.log)
    assert logged[0] == ("pod-a", 1) and sorted(logged) == [("pod-a", 1), ("pod-b", 1), ("pod-c", 1)]
    await same_state_as_the_log(ledger)


async def test_a_led_group_the_log_refuses_fails_its_step_alone_and_the_group_on_top_is_decided_again(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = Held(ledger.log, gate=anyio.Event(), refuse=True)
    held.install(monkeypatch)
    gate = held.gate
    assert gate is not None
    committer = committer_on(ledger)
    answered: dict[str, StepCommit | Commit | BaseException] = {}

    async def submit(engine: str, number: int) -> None:
        try:
            answered[engine] = await committer.submit(step(engine, number))
        except Exception as error:  # noqa: BLE001 - the test looks at which step failed, and how
            answered[engine] = error

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(committer.run)
        await parked(committer)
        tasks.start_soon(submit, "pod-a", 1)
        with anyio.fail_after(5):
            await held.arrived.wait()
        tasks.start_soon(submit, "pod-b", 1)
        try:
            with anyio.fail_after(5):
                while ledger.in_flight < 2:  # the committer decided on top of the held group
                    await anyio.sleep(0.001)
        finally:
            gate.set()
        with anyio.fail_after(5):
            while len(answered) < 2:
                await anyio.sleep(0.001)
        # The committer serves the next step as before.
        await parked(committer)
        after = await committer.submit(step("pod-c", 1))
        committer.close()
    assert isinstance(answered["pod-a"], AppendRejected), answered["pod-a"]
    second = answered["pod-b"]
    assert isinstance(second, StepCommit) and not second.commit.duplicate
    assert isinstance(after, StepCommit)
    assert await steps_in_log(ledger.log) == [("pod-b", 1), ("pod-c", 1)]
    await same_state_as_the_log(ledger)
    async with ledger.committed() as live:
        assert sorted(owner.req_id for owner in live.owners.values()) == ["pod-b-1", "pod-c-1"]


async def test_a_drain_waits_for_a_led_group(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed while a led group is appended, and again while it is published (its append landed,
    out of the committer's groups in flight): the committer stops only once it is answered."""
    for hold in ("append", "publication"):
        held = Held(ledger.log, gate=anyio.Event() if hold == "append" else None)
        held.install(monkeypatch)
        committer = committer_on(ledger)
        gate = held.gate or anyio.Event()
        arrived = held.arrived if hold == "append" else anyio.Event()
        if hold == "publication":
            publish_from_log = committer.hub.publish_from_log

            async def held_publication(up_to: int) -> None:
                arrived.set()
                await gate.wait()
                await publish_from_log(up_to)

            monkeypatch.setattr(committer.hub, "publish_from_log", held_publication)
        order: list[str] = []

        async def run() -> None:
            await committer.run()
            order.append("committer stopped")

        async def submit(number: int) -> None:
            result = await committer.submit(step("pod-a", number))
            assert isinstance(result, StepCommit)
            order.append("answered")

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(run)
            await parked(committer)
            tasks.start_soon(submit, 1 if hold == "append" else 2)
            with anyio.fail_after(5):
                await arrived.wait()
            committer.close()
            try:
                await anyio.sleep(0.05)
                early = list(order)
            finally:
                gate.set()  # before any assertion: the held task is shielded and would wait for ever
        assert early == [], f"the committer stopped while a led group's {hold} was held"
        assert order == ["answered", "committer stopped"], hold
        monkeypatch.undo()
    assert await steps_in_log(ledger.log) == [("pod-a", 1), ("pod-a", 2)]
