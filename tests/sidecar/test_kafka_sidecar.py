"""`kvledger serve --log kafka://...` as a real process while its broker dies (issue 8, item 4).

Each test starts its own Tansu broker (tests/kit/kafka.py, KafkaBroker, not the session's: it is
killed or paused here) and a real sidecar on it, with a short request timeout so that an
unreachable broker shows within seconds. An engine runs steps, each with its own command id.

* SIGKILL, then restart: Tansu keeps data in memory, so the restarted broker has lost the topic.
  The sidecar reports unhealthy while the broker is gone, then fails closed naming the loss: it
  never appends to the new, empty topic (a forked history), /readyz stays 503, and a restart of the
  sidecar (after a SIGKILL) on the same topic and state store refuses to start.
* SIGSTOP, then SIGCONT (the broker briefly unreachable): the sidecar reports unhealthy, then
  recovers, and every step it reported committed is in the log exactly once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from coordinator.client import Address, EngineClient, SidecarError, SidecarUnavailable
from coordinator.core.commands import StartOwner
from events import EventCodec, OwnerStarted, StepBegan
from events.log import open_log
from events.log.kafka_target import parse_kafka_url
from tests.conftest import REQUIRE_KAFKA, unavailable
from tests.kit.kafka import BrokerUnavailable, KafkaBroker, free_port
from tests.kit.sidecar import ROOT, TIER_SPEC, ServeProcess, declaration

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

LOSS = ("lost committed records", "went backwards")
"""What the sidecar's reason says when the topic lost what it had committed."""


@pytest.fixture
def broker() -> Iterator[KafkaBroker]:
    """A broker of this test's own, which it may kill."""
    try:
        broker = KafkaBroker.start()
    except BrokerUnavailable as missing:
        unavailable(f"no Kafka broker for the tests: {missing}", REQUIRE_KAFKA, "KVLEDGER_REQUIRE_KAFKA")
    try:
        yield broker
    finally:
        if broker.process is not None and broker.process.poll() is None:
            broker.process.send_signal(signal.SIGCONT)
        broker.stop()


class Served:
    """`kvledger serve` on the broker's topic, with /readyz on a free port."""

    def __init__(self, directory: Path, broker: KafkaBroker) -> None:
        self.url = broker.url(state=directory / "state.sqlite", fetch_wait_ms=10, request_timeout_ms=1000)
        self.http = free_port()
        self.server = ServeProcess(directory, "--log", self.url, "--http", f"127.0.0.1:{self.http}")

    def readyz(self) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/readyz", timeout=5) as reply:
                return reply.status, str(json.loads(reply.read())["reason"])
        except urllib.error.HTTPError as error:
            return error.code, str(json.loads(error.read())["reason"])


def client_for(served: Served) -> EngineClient:
    return EngineClient(
        Address(socket_path=str(served.server.socket)), declaration("pod-a"), tiers=[TIER_SPEC], retry_for=0.3, reply_timeout=30
    )


async def step(client: EngineClient, number: int) -> tuple[int, int] | str:
    """Step `number` (its command id is its own, so a retry is answered from the log): its
    positions, or the error it was refused with."""
    try:
        result = await client.step(
            number, float(number), [StartOwner(engine_id="pod-a", req_id=f"r{number}")], command_id=f"step-{number}"
        )
    except (SidecarError, SidecarUnavailable) as error:
        return str(error)
    return result.first_seq, result.last_seq


async def wait_stopped(pid: int) -> None:
    """Until every thread of `pid` is stopped: SIGSTOP takes effect when each thread is next
    scheduled, and on a loaded machine a broker thread still answered a produce 4 ms after the
    signal was sent (the step was then rightly committed, and the test took it for a bug)."""
    with anyio.fail_after(10):
        while True:
            states = []
            for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
                try:
                    states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
                except (OSError, IndexError):
                    continue  # a thread that just ended
            if states and all(state in ("T", "t") for state in states):
                return
            await anyio.sleep(0.005)


async def until_unready(served: Served, client: EngineClient, number: int, seconds: float) -> tuple[list[str], str]:
    """Step `number` again and again until /readyz answers 503: the refusals, and its reason."""
    refusals: list[str] = []
    with anyio.fail_after(seconds):
        while True:
            outcome = await step(client, number)
            assert isinstance(outcome, str), f"step {number} was committed while the broker was down: {outcome}"
            refusals.append(outcome)
            status, reason = await anyio.to_thread.run_sync(served.readyz)
            if status == 503:
                return refusals, reason


def test_a_broker_killed_and_restarted_empty_fails_the_sidecar_closed_naming_the_loss(
    tmp_path: Path, broker: KafkaBroker
) -> None:
    served = Served(tmp_path, broker)
    served.server.start()
    try:
        committed: dict[int, tuple[int, int]] = {}

        async def run() -> None:
            async with client_for(served) as client:
                for number in range(1, 6):
                    outcome = await step(client, number)
                    assert not isinstance(outcome, str), outcome
                    committed[number] = outcome
                assert served.readyz() == (200, "ready")

                assert broker.process is not None
                broker.process.kill()  # SIGKILL: its in-memory topic is gone with it
                broker.process.wait()
                refusals, reason = await until_unready(served, client, 6, 30)
                assert "was not committed" in refusals[0], refusals
                assert "log" in reason, reason  # e.g. the log refused the last append: LogUnavailable: cannot reach ...

                await anyio.to_thread.run_sync(broker._run)  # the same port, an empty broker
                with anyio.fail_after(30):
                    while True:
                        outcome = await step(client, 6)
                        assert isinstance(outcome, str), f"step 6 was appended to the broker's new, empty topic: {outcome}"
                        if any(words in outcome for words in LOSS):
                            break
                        await anyio.sleep(0.1)
                status, reason = served.readyz()
                assert status == 503 and reason.startswith("the log failed closed: "), reason
                assert any(words in reason for words in LOSS), reason
                assert "refusing to continue a forked history" in reason
                # It stays closed: no later step is taken, and readiness does not come back.
                again = await step(client, 7)
                assert isinstance(again, str) and any(words in again for words in LOSS), again
                assert served.readyz()[0] == 503

        anyio.run(run)
        served.server.kill()  # SIGKILL: nothing is saved at shutdown
        # A restarted sidecar on the same topic and state store refuses the topic that lost its history.
        restarted = subprocess.run(
            [*served.server.args[:-4], "--log", served.url, "--http", "off"],
            cwd=ROOT,
            env=served.server.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert restarted.returncode == 1, restarted.stderr[-2000:]
        last = restarted.stderr.strip().splitlines()[-1]
        assert "kvledger serve: " in last and "lost its history" in last, last
        assert committed, "the engine saw steps committed before the kill"
    finally:
        served.server.kill()


def test_a_briefly_unreachable_broker_makes_the_sidecar_unready_then_it_recovers_exactly_once(
    tmp_path: Path, broker: KafkaBroker
) -> None:
    served = Served(tmp_path, broker)
    served.server.start()
    try:
        committed: dict[int, tuple[int, int]] = {}

        async def run() -> None:
            async with client_for(served) as client:
                for number in range(1, 6):
                    outcome = await step(client, number)
                    assert not isinstance(outcome, str), outcome
                    committed[number] = outcome

                assert broker.process is not None
                broker.process.send_signal(signal.SIGSTOP)
                await wait_stopped(broker.process.pid)
                try:
                    refusals, reason = await until_unready(served, client, 6, 30)
                finally:
                    broker.process.send_signal(signal.SIGCONT)
                assert "was not committed" in refusals[0] and "log" in reason, (refusals, reason)

                with anyio.fail_after(30):  # step 6, retried with its command id, until it is taken
                    while isinstance(outcome := await step(client, 6), str):
                        assert not any(words in outcome for words in LOSS), outcome
                        await anyio.sleep(0.1)
                committed[6] = outcome
                assert served.readyz() == (200, "ready")
                for number in range(7, 11):
                    outcome = await step(client, number)
                    assert not isinstance(outcome, str), outcome
                    committed[number] = outcome

        anyio.run(run)
        served.server.signal(signal.SIGTERM)
        assert served.server.wait() == 0

        async def check() -> None:
            reader = await open_log(served.url.replace("state.sqlite", "reader.sqlite"))
            try:
                stored = await reader.read(0, 1_000_000)
            finally:
                await reader.close()
            codec = EventCodec()
            began = [
                (s.global_seq, codec.decode(s.event_type, s.schema_version, s.payload))
                for s in stored
                if s.stream_id == "engine/pod-a" and s.event_type == "step_began"
            ]
            steps = [event.step for _, event in began if isinstance(event, StepBegan)]
            assert steps == list(range(1, 11)), f"steps in the log: {steps}"
            first_seqs = dict(zip(steps, (seq for seq, _ in began), strict=True))
            assert {number: first for number, (first, _) in committed.items()} == first_seqs, (
                "an answer is not where the log has it"
            )
            owners = [codec.decode(s.event_type, s.schema_version, s.payload) for s in stored if s.event_type == "owner_started"]
            assert sorted(e.req_id for e in owners if isinstance(e, OwnerStarted)) == sorted(f"r{n}" for n in range(1, 11))

        anyio.run(check)
    finally:
        served.server.kill()


def test_the_request_timeout_is_a_url_parameter() -> None:
    """How soon an unreachable broker shows: ?request_timeout_ms= (a call waits twice that)."""
    target = parse_kafka_url("kafka://b1:9092,b2:9092/kvl-events?request_timeout_ms=1000")
    assert (target.request_timeout_ms, target.call_timeout_s) == (1000, 2.0)
    assert parse_kafka_url("kafka://b1:9092/kvl-events").call_timeout_s == 30.0
    with pytest.raises(ValueError, match="request_timeout_ms 5 is below 100"):
        parse_kafka_url("kafka://b1:9092/kvl-events?request_timeout_ms=5")


def test_an_idle_sidecar_reports_a_paused_broker_unready_and_recovers_without_a_step(tmp_path: Path, broker: KafkaBroker) -> None:
    """No engine steps while the broker is paused: the sidecar's own look at the log (every
    2 s) is what turns /readyz to 503, naming the log, and back to 200 once the broker answers."""
    served = Served(tmp_path, broker)
    served.server.start()
    try:

        async def run() -> None:
            async with client_for(served) as client:
                assert not isinstance(await step(client, 1), str)
            assert served.readyz() == (200, "ready")
            assert broker.process is not None
            broker.process.send_signal(signal.SIGSTOP)
            await wait_stopped(broker.process.pid)
            try:
                with anyio.fail_after(30):
                    while (found := await anyio.to_thread.run_sync(served.readyz))[0] != 503:
                        await anyio.sleep(0.2)
            finally:
                broker.process.send_signal(signal.SIGCONT)
            assert found[1].startswith("the log is unreachable: ") and "log kafka://" in found[1], found
            with anyio.fail_after(30):
                while (found := await anyio.to_thread.run_sync(served.readyz)) != (200, "ready"):
                    await anyio.sleep(0.2)
            async with client_for(served) as client:
                assert not isinstance(await step(client, 2), str)

        anyio.run(run)
        served.server.signal(signal.SIGTERM)
        assert served.server.wait() == 0
        log_lines = served.server.stderr()
        assert "log_probe_failed" in log_lines and "log_probe_recovered" in log_lines, log_lines[-2000:]
    finally:
        served.server.kill()
