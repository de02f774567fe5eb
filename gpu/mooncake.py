"""A Mooncake Store as a tier (issue 21): kvledger decides the tier's slots, the bytes live in a
Mooncake Store that every engine naming the same master shares.

What a Mooncake Store does that the tier guards against (each seen on these machines with
mooncake-transfer-engine 0.3.13.post1):

* a `put` of an existing object name returns 0 and keeps the FIRST value, even of another size:
  each object name here holds the tier slot's generation (a new one each time kvledger gives the
  slot to a key, I1) beside the key, so a key stored again is a new object, and old bytes can
  never come back under a new store;
* the store evicts on its own past ~90% of a segment, with no notice, and a client killed with
  SIGKILL leaves `is_exist` true for ~10 s while `get` returns nothing: a missing, empty or short
  object is a failed read (TierError naming what Mooncake answered), never a crash;
* every read is checked against the published checksum by the worker before a byte is copied
  (gpu.worker, I13), as on every tier.

Each worker rank has a MooncakeTier of its own (its shard of a block is an object of its own);
ranks of every engine that declared the tier share the store.

`load_store()` imports the client. On a machine with the wheel installed and NVIDIA's driver,
that is all; here, `ops/tools/install-mooncake.sh` puts the wheel, the RDMA libraries it links
and a libcuda stub under .tools/mooncake (KVLEDGER_MOONCAKE_HOME), and `load_store` loads them
first. `master_command` / `master_environment` start a master from the same install (tests,
ops/bench/tiers.py); a user points kvledger's workers at their own master instead.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog
import torch

from gpu.checksum import checksum, tensor_bytes
from gpu.device import host_buffer
from gpu.tiers import TierError

log = structlog.get_logger("kvledger.mooncake")

HOME_ENV = "KVLEDGER_MOONCAKE_HOME"
"""Where ops/tools/install-mooncake.sh put the Mooncake install (default: .tools/mooncake)."""
DEFAULT_HOME = Path(__file__).resolve().parents[1] / ".tools" / "mooncake"

SONAME = re.compile(r"^lib[\w+-]+\.so\.\d+$")
"""A library's name as a program asks for it (libibverbs.so.1), not its full version."""


ERRORS = {
    -704: "object not found",
    -706: "object has a lease (a read is under way)",
    -800: "the segment's client is gone",
    -900: "the master cannot be reached",
}
"""What Mooncake's return codes mean, as seen here (its error table names more)."""


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME)


def library_directories(where: Path) -> list[Path]:
    """What a process from this install needs on LD_LIBRARY_PATH (the master: it is a program)."""
    return [
        where / "stub",
        where / "debs" / "usr" / "lib" / "x86_64-linux-gnu",
        where / "debs" / "lib" / "x86_64-linux-gnu",
        where / "site" / "nvidia" / "cuda_runtime" / "lib",
    ]


def load_store(where: Path | None = None) -> Any:
    """The client class (mooncake.store.MooncakeDistributedStore). From `where` (or home()) when
    it holds an install: its libraries are loaded into this process first (by full path, so the
    client's own dependencies resolve to them without LD_LIBRARY_PATH) and its site directory
    goes on sys.path. Raises ImportError naming what is missing."""
    where = where or home()
    if (where / "ready").exists():
        _preload([path for directory in library_directories(where) if directory.is_dir() for path in directory.iterdir()])
        site = str(where / "site")
        if site not in sys.path:
            sys.path.append(site)
    try:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]
    except ImportError as error:
        raise ImportError(
            f"the Mooncake client does not import ({error}); install it with `sh ops/tools/install-mooncake.sh` "
            f"(into {DEFAULT_HOME}) or `pip install mooncake-transfer-engine`"
        ) from error
    return MooncakeDistributedStore


def _preload(candidates: list[Path]) -> None:
    """Load each library (by its soname's file) once its own dependencies are loaded: in passes,
    until a pass loads nothing new. What stays unloadable is left for the import to name."""
    pending = sorted(path for path in candidates if SONAME.match(path.name))
    while pending:
        failed = []
        for path in pending:
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                failed.append(path)
        if len(failed) == len(pending):
            return
        pending = failed


def master_command(
    where: Path, *, rpc_port: int, http_port: int, metrics_port: int, lease_ms: int = 5000, host: str = "127.0.0.1"
) -> list[str]:
    """A master on `host`, with its HTTP metadata server (what the clients' setup names)."""
    return [
        str(where / "site" / "mooncake" / "mooncake_master"),
        f"--rpc_address={host}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={http_port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
        f"--default_kv_lease_ttl={lease_ms}",
    ]


def master_environment(where: Path) -> dict[str, str]:
    paths = [str(path) for path in library_directories(where)]
    if os.environ.get("LD_LIBRARY_PATH"):
        paths.append(os.environ["LD_LIBRARY_PATH"])
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(paths)}


def connect(
    master: str, metadata_url: str, *, segment_bytes: int = 64 << 20, buffer_bytes: int = 16 << 20, host: str = "127.0.0.1"
) -> Any:
    """A client of the store whose master is `master` ("host:port"), over TCP. It contributes a
    segment of `segment_bytes` to the store (where objects live) and a local buffer."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    store = load_store()()
    rc = store.setup(host, metadata_url, segment_bytes, buffer_bytes, "tcp", "", master)
    if rc != 0:
        raise TierError("setup_failed", f"Mooncake client setup against master {master} returned {rc} ({_meaning(rc)})")
    return store


def _meaning(rc: int) -> str:
    return ERRORS.get(rc, "see Mooncake's error codes")


class MooncakeTier:
    """One rank's view of a Mooncake Store tier: object `PREFIX/TIER/SLOT/GENERATION/KEY/RANK`."""

    def __init__(
        self,
        name: str,
        store: Any,
        *,
        rank: int,
        device: torch.device | None,
        prefix: str = "kvledger",
        master: str = "",
        metadata_url: str = "",
    ) -> None:
        self.name = name
        self.store = store
        self.rank = rank
        self.device = device
        self.prefix = prefix
        self.master = master
        self.metadata_url = metadata_url
        """Where `store` is connected, when the maker said (a scenario starts other clients there)."""
        self.preferred_segment: str | None = None
        """Put objects in this client's segment (Mooncake's ReplicateConfig.preferred_segment);
        None: where the master places them. The simulator's dead-client scenario sets it."""

    def object_name(self, key: bytes, slot: int, generation: int) -> str:
        return f"{self.prefix}/{self.name}/{slot}/{generation}/{key.hex()}/{self.rank}"

    def write(self, key: bytes, data: torch.Tensor, *, slot: int, generation: int = 0) -> bytes:
        payload = tensor_bytes(data)
        name = self.object_name(key, slot, generation)
        if self.preferred_segment:
            config = sys.modules["mooncake.store"].ReplicateConfig()  # imported with the store's class
            config.preferred_segment = self.preferred_segment
            rc = self.store.put(name, payload, config)
        else:
            rc = self.store.put(name, payload)
        if rc != 0:
            raise TierError("put_failed", f"Mooncake put of {name} returned {rc} ({_meaning(rc)})")
        return checksum(payload)

    def read(self, key: bytes, nbytes: int, *, slot: int, generation: int = 0) -> torch.Tensor:
        name = self.object_name(key, slot, generation)
        payload = self.store.get(name)
        if not payload:
            raise TierError(
                "missing",
                f"Mooncake has no value for {name} (evicted by the store, or the client holding its segment is gone)",
            )
        if len(payload) < nbytes:
            raise TierError("truncated", f"Mooncake's {name} holds {len(payload)} bytes, expected {nbytes}")
        if len(payload) > nbytes:
            raise TierError("size_mismatch", f"Mooncake's {name} holds {len(payload)} bytes, more than the {nbytes} expected")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # a copy of its own, writable
        if self.device is None or self.device.type != "cuda":
            return data
        buffer = host_buffer(nbytes, self.device)  # pinned: the copy to the device can be async
        buffer.copy_(data)
        return buffer

    def delete(self, key: bytes) -> None:
        """Objects are named by slot and generation too: see `remove`."""
        raise NotImplementedError("a Mooncake tier removes an object by its slot and generation: remove()")

    def retire(self, previous: Iterable[tuple[int, int]]) -> int:
        """Remove the objects, every rank's, of each (slot, generation) given: what a slot held
        before kvledger gave it to another key (issue 21: kvledger's evictions remove objects).

        A store calls it for its items' slots at the generation before theirs, so the store never
        holds more of this tier's objects than its slots (times the ranks) however many keys come
        and go; the objects of a slot that is not given out again stay until Mooncake evicts them,
        and no lookup offers their keys. Forced: a slot is given to a new key only once its old
        key is evicted, which kvledger never does while a load's lease holds it (I12), so no
        reader of kvledger's remains, whatever lease Mooncake's own gets left (-706 unforced).
        One call to the master for all of them. Returns how many objects it removed; a removal
        that fails is logged (the space waits for Mooncake's eviction), never a failed store."""
        pairs = sorted({(slot, generation) for slot, generation in previous if generation > 0})
        if not pairs:
            return 0
        alternatives = "|".join(f"{slot}/{generation}" for slot, generation in pairs)
        pattern = f"^{re.escape(self.prefix)}/{re.escape(self.name)}/({alternatives})/"
        removed = int(self.store.remove_by_regex(pattern, True))
        if removed < 0:
            log.warning("mooncake_retire_failed", tier=self.name, slots=len(pairs), rc=removed, meaning=_meaning(removed))
            return 0
        return removed

    def close(self) -> None:
        """Close this rank's client (its segment's objects leave the store with it)."""
        self.store.close()

    def remove(self, key: bytes, *, slot: int, generation: int, force: bool = False) -> int:
        """Remove one object (an eviction kvledger decided). `force` only when kvledger's lease
        says no reader remains: Mooncake refuses (-706) while a read holds its own lease."""
        return int(self.store.remove(self.object_name(key, slot, generation), force))


class SegmentHolder:
    """Another Mooncake client, in a child process of its own, that mounts a segment and holds it
    until killed: where a store's objects can be placed (MooncakeTier.preferred_segment) to see
    what Mooncake does when that client dies (SIGKILL: `is_exist` still 1, `get` empty, puts
    there -800). For tests and the simulator's dead-client scenario."""

    def __init__(self, process: subprocess.Popen[bytes], segment: str) -> None:
        self.process = process
        self.segment = segment

    @classmethod
    def start(cls, master: str, metadata_url: str, *, timeout: float = 30.0) -> SegmentHolder:
        code = (
            "import sys, time\n"
            "from gpu import mooncake\n"
            f"client = mooncake.connect({master!r}, {metadata_url!r})\n"
            "print(client.get_hostname(), flush=True)\n"
            "time.sleep(3600)\n"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=Path(__file__).resolve().parents[1],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        segment = process.stdout.readline().decode().strip() if ready else ""
        if not segment:
            process.kill()
            process.wait()
            raise TierError("setup_failed", f"a Mooncake client against master {master} did not start within {timeout} s")
        return cls(process, segment)

    def kill(self) -> None:
        """SIGKILL: the client goes without a word to the master."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
