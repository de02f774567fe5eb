"""A real Mooncake Store master for the tests (issue 21): the install ops/tools/install-mooncake.sh
made (`make test` runs it), on free loopback ports, one per test session. Without an install the
Mooncake tests skip saying why; with KVLEDGER_REQUIRE_MOONCAKE=1 (.ci/run) they fail instead."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from gpu import mooncake
from tests.kit.kafka import free_port

REQUIRE = os.environ.get("KVLEDGER_REQUIRE_MOONCAKE") == "1"


class MooncakeUnavailable(Exception):
    pass


class MooncakeMaster:
    def __init__(self, process: subprocess.Popen[bytes], rpc_port: int, http_port: int, log: Path) -> None:
        self.process = process
        self.address = f"127.0.0.1:{rpc_port}"
        self.metadata_url = f"http://127.0.0.1:{http_port}/metadata"
        self.log = log

    @classmethod
    def start(cls, directory: Path, *, lease_ms: int = 5000) -> MooncakeMaster:
        where = mooncake.home()
        if not (where / "ready").exists():
            raise MooncakeUnavailable(f"no Mooncake install at {where}: run `sh ops/tools/install-mooncake.sh`")
        try:
            mooncake.load_store(where)
        except (ImportError, OSError) as error:
            raise MooncakeUnavailable(f"the Mooncake client at {where} does not load: {error}") from error
        rpc, http, metrics = free_port(), free_port(), free_port()
        log = directory / "mooncake_master.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                mooncake.master_command(where, rpc_port=rpc, http_port=http, metrics_port=metrics, lease_ms=lease_ms),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=mooncake.master_environment(where),
            )
        master = cls(process, rpc, http, log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise MooncakeUnavailable(f"mooncake_master exited with {process.returncode}: {log.read_text()[-2000:]}")
            if _answers(http) and _answers(rpc):
                return master
            time.sleep(0.05)
        master.stop()
        raise MooncakeUnavailable(f"mooncake_master did not listen within 30 s: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
