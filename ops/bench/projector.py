"""Benchmark: projector fold throughput (target >= 1,000,000 events/s on one core).

    .venv/bin/python ops/bench/projector.py [--events 1000000] [--repeat 3]

Generates a realistic event mix with the real decider (ops/bench/workload.py), then folds the
whole list from an empty state several times and prints the best and median rate. Only the fold
is timed: generation is not part of the figure. Beside it, in the same run, the ceiling: a
trivial dict fold of the same events (each dispatched on its type, as the projector does, to a
handler that keeps it in a dict by its type and engine), so the figure reads as a ratio (issue 22: fold >= 0.5x
the ceiling). Ends with the plain line `fold/ceiling ratio R` (best against best).
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import core_build  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from workload import Workload  # noqa: E402

from coordinator.core.projector import project  # noqa: E402
from coordinator.core.state import state_digest  # noqa: E402
from events import EVENT_TYPES, Event, event_tag  # noqa: E402


def _keep(state: dict[tuple[type, str], Event], event: Event) -> None:
    state[type(event), getattr(event, "engine_id", "")] = event


TRIVIAL_HANDLERS = dict.fromkeys(EVENT_TYPES, _keep)


def trivial_fold(events: list[Event]) -> dict[tuple[type, str], Event]:
    """The ceiling: the projector's shape (a dispatch on the event's type) with the least work a
    fold does: one field read and one dict entry written per event."""
    state: dict[tuple[type, str], Event] = {}
    handlers = TRIVIAL_HANDLERS
    for event in events:
        handlers[type(event)](state, event)
    return state


def best_rate(events: list[Event], fold: object, repeat: int) -> list[float]:
    rates = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        fold(events)  # type: ignore[operator]
        elapsed = time.perf_counter() - start
        gc.enable()
        rates.append(len(events) / elapsed)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    console = Console(stderr=True)

    workload = Workload(seed=args.seed)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("generating events with the decider", total=args.events)
        for count in workload.run(args.events):
            progress.update(task, completed=count)
    events = workload.core.events
    mix = collections.Counter(event_tag(type(e)) for e in events)
    console.print(
        f"{len(events):,} events over {workload.step:,} steps; mix: "
        + ", ".join(f"{tag} {n / len(events):.1%}" for tag, n in mix.most_common(10))
    )

    print(core_build())
    rates = []
    for attempt in range(args.repeat):
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        state = project(events)
        elapsed = time.perf_counter() - start
        gc.enable()
        rates.append(len(events) / elapsed)
        console.print(f"run {attempt + 1}: {len(events):,} events in {elapsed:.3f} s = {rates[-1]:,.0f} events/s")
    assert state_digest(state) == state_digest(workload.core.state), "fold disagrees with the live state"
    print(
        f"projector fold: best {max(rates):,.0f} events/s, median {statistics.median(rates):,.0f} events/s "
        f"({len(events):,} events, target 1,000,000 events/s)"
    )
    ceiling = best_rate(events, trivial_fold, args.repeat)
    ratio = max(rates) / max(ceiling)
    print(
        f"ceiling, a trivial dict fold of the same events: best {max(ceiling):,.0f} events/s; "
        f"target fold >= 0.5x: {'met' if ratio >= 0.5 else 'MISSED'}"
    )
    print(f"fold/ceiling ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
