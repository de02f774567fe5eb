"""What every benchmark prints the same way: figures to stdout, progress and notes to stderr,
the load average and the core's build beside the figures, nearest-rank percentiles."""

from __future__ import annotations

import os

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from coordinator import _compiled
from coordinator.simulator.workload import percentile as workload_percentile

console = Console(stderr=True)


def progress() -> Progress:
    """A progress bar on stderr, shown only on a terminal."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def out(line: str) -> None:
    """One figure line on stdout."""
    print(line, flush=True)


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


def core_build() -> str:
    """How the pure core runs: how many of its modules compiled with Cython (setup.py), or why not."""
    return _compiled.summary()


# Nearest-rank, the one the simulator's report uses too (it was round(fraction x n + 0.5) here,
# which banker's rounding took one rank too far at exact ranks: p99 of 100 values gave the 100th).
percentile = workload_percentile
