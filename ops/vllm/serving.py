"""A `kvledger serve` for the live proofs and benchmarks that run in the vLLM environment.

The sidecar runs from the project's venv (`--kvledger`, default .venv/bin/kvledger), never the
vLLM one, on a SQLite log, its output in a file; its socket lives in a short directory of its own
(a Unix socket path is at most 108 bytes). Used by prove.py, two_ranks.py and
ops/bench/vllm_overhead.py.
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_KVLEDGER = REPO / ".venv" / "bin" / "kvledger"


class Sidecar:
    def __init__(self, socket: Path, process: subprocess.Popen[bytes]) -> None:
        self.socket = socket
        self.process = process
        self.exit_code: int | None = None
        """Its exit status once stopped (0: a clean SIGTERM)."""


def wait_for_socket(path: Path, sidecar: subprocess.Popen[bytes], limit_s: float = 60.0, who: str = "kvledger") -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.exists():
            return
        if sidecar.poll() is not None:
            raise SystemExit(f"{who}: kvledger serve exited with {sidecar.returncode} before listening")
        time.sleep(0.1)
    raise SystemExit(f"{who}: kvledger serve did not create {path} in {limit_s} s")


def stop(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL after `timeout_s`; the exit status."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@contextmanager
def kvledger_serve(kvledger: Path, log: Path, output: Path, who: str = "kvledger") -> Iterator[Sidecar]:
    """`kvledger serve --log LOG` on a fresh socket, listening when this yields; stopped (SIGTERM)
    after, its exit status in `Sidecar.exit_code`."""
    socket_dir = Path(tempfile.mkdtemp(prefix="kvl-"))
    socket = socket_dir / "s.sock"
    with output.open("wb") as sink:
        process = subprocess.Popen(
            [str(kvledger), "serve", "--log", str(log), "--socket", str(socket), "--http", "off"],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        sidecar = Sidecar(socket, process)
        try:
            wait_for_socket(socket, process, who=who)
            yield sidecar
        finally:
            sidecar.exit_code = stop(process)
            socket.unlink(missing_ok=True)
            socket_dir.rmdir()
