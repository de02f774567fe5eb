"""A writer process for the log contract tests (tests/log/test_log_contract.py).

    python -m tests.kit.log_writer URL STREAM STEPS EVENTS_PER_STEP [PAUSE_SECONDS]

Opens the log with events.log.open_log and appends STEPS steps (0: forever, until killed) of
EVENTS_PER_STEP events each to its own stream STREAM, one atomic append per step, each with a
command id. It continues the stream where it stands, so a restarted writer picks up after the
last committed step. Prints "ready" once the log is open; with $KVLEDGER_TEST_WRITER_WAIT=1 it
then waits for a line on stdin (a start barrier for several writers). After every committed
step it prints "committed FIRST_SEQ LAST_SEQ STREAM_VERSION", flushed, so a parent knows
exactly what was committed before it killed the process.

The events' ids and payloads are deterministic (`pending_event`, `payload_for`), so the tests
can check that every stored byte is the byte that was appended.
"""

from __future__ import annotations

import os
import sys

import anyio

from events.log import AppendBatch, AppendResult, EventLog, PendingEvent, open_log

EVENT_TYPE = "contract_test_event"


def payload_for(stream: str, step: int, index: int) -> bytes:
    """The payload of event `index` (0-based) of `step` (1-based) in `stream`; includes
    non-text bytes so a rewrite or a text round trip would show."""
    head = f"{stream}|{step}|{index}|".encode()
    return head + bytes(range(index % 7, 256, 7)) + head


def event_id_for(stream: str, step: int, index: int) -> str:
    return f"{stream}/{step}/{index}"


def command_id_for(stream: str, step: int) -> str:
    return f"cmd/{stream}/{step}"


def pending_event(stream: str, step: int, index: int) -> PendingEvent:
    return PendingEvent(
        event_id=event_id_for(stream, step, index),
        step=step,
        recorded_at=1_000_000.0 + step + index / 1000,
        event_type=EVENT_TYPE,
        schema_version=1,
        payload=payload_for(stream, step, index),
    )


def step_batch(stream: str, step: int, per_step: int) -> AppendBatch:
    """Step `step` (1-based) of `stream`: the stream is at (step - 1) * per_step before it."""
    return AppendBatch(
        stream_id=stream,
        expected_version=(step - 1) * per_step,
        events=[pending_event(stream, step, index) for index in range(per_step)],
        command_id=command_id_for(stream, step),
    )


async def append_steps(
    event_log: EventLog, stream: str, steps: int, per_step: int, pause: float = 0.0, report: bool = False
) -> list[AppendResult]:
    """Append `steps` steps (0: forever) after the stream's last whole step."""
    version = await event_log.stream_version(stream)
    if version % per_step:
        raise RuntimeError(f"stream {stream!r} holds a partial step: version {version}, {per_step} per step")
    step = version // per_step
    results: list[AppendResult] = []
    while steps == 0 or len(results) < steps:
        step += 1
        [result] = await event_log.append([step_batch(stream, step, per_step)])
        results.append(result)
        if report:
            sys.stdout.write(f"committed {result.first_seq} {result.last_seq} {result.stream_version}\n")
            sys.stdout.flush()
        if pause:
            await anyio.sleep(pause)
    return results


async def main(url: str, stream: str, steps: int, per_step: int, pause: float) -> None:
    event_log = await open_log(url)
    try:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        if os.environ.get("KVLEDGER_TEST_WRITER_WAIT") == "1":
            await anyio.to_thread.run_sync(sys.stdin.readline)
        await append_steps(event_log, stream, steps, per_step, pause, report=True)
    finally:
        await event_log.close()


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    anyio.run(
        main,
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        float(sys.argv[5]) if len(sys.argv) == 6 else 0.0,
    )
