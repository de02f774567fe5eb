"""A worker rank: it acts only on committed decisions and reports per (job, rank).

* store: each source block shard, device -> tier, under its content key; the report carries the
  checksum of the bytes written.
* load: each key is read from the tier once, however many destinations name it (I11), and
  checked against the published checksum before anything is copied (I13); then every
  destination is filled and verified. A mismatch, a missing or truncated file, a bad block or a
  size mismatch is reported as a failure with its reason, never as success; the worker goes on.

Both address the tier with the item's key and its tier slot (gpu/tiers.py): a slot-addressed
tier returns what the slot holds now, which is why the published checksum is checked.
* state copy: the planned batches, in order (gpu/copies.py, I15).

Transfers run on the transfer stream, after the compute stream's work (gpu/device.py).

Exactly once across restarts: before a report is sent it is saved with its decision's sequence
in the worker's state file (written to a temporary name, fsynced, renamed); once committed the
sequence is the acknowledged one. A restarted worker first re-sends a saved report (reports are
idempotent, I4), then subscribes after the acknowledged sequence: nothing is executed twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import structlog
import torch

from coordinator.client import WorkerClient
from coordinator.core.commands import ReportRank
from coordinator.core.protections import Protection
from coordinator.core.routing import Decision
from events import LoadItem, LoadJobStarted, StateCopyPlanned, StoreItem, StoreJobStarted
from gpu.checksum import checksum
from gpu.copies import CopyError, execute_plan
from gpu.device import TransferStream
from gpu.mooncake import MooncakeTier
from gpu.pools import DevicePools, TransferError
from gpu.tiers import Tier, TierError

log = structlog.get_logger("kvledger.worker")

LOST = frozenset({"missing", "truncated", "size_mismatch"})
"""TierError reasons that mean the tier no longer holds a key's bytes (ReportRank.lost)."""


class Pending(msgspec.Struct, frozen=True):
    seq: int
    report: ReportRank


class WorkerState(msgspec.Struct, frozen=True):
    acked: int = 0
    """The sequence of the last decision whose report the coordinator committed."""
    pending: Pending | None = None
    """A report saved but not yet known to be committed."""


class Worker:
    def __init__(
        self,
        engine_id: str,
        rank: int,
        pools: DevicePools,
        tiers: dict[str, Tier],
        state_path: Path | None = None,
        *,
        protections_off: frozenset[Protection] = frozenset(),
    ) -> None:
        self.protections_off = protections_off
        """Empty except in the simulator's fault scenarios (coordinator.core.protections)."""
        self.engine_id = engine_id
        self.rank = rank
        self.pools = pools
        self.tiers = tiers
        self.stream = TransferStream(pools.device)
        self.state_path = state_path
        self.state = self._load_state()
        self.executed: list[int] = []
        """Sequences of the decisions this process executed (for tests and logs)."""
        self._unfenced: list[tuple[Tier, StoreItem, torch.Tensor]] = []
        """Store copies reported but not yet run: only with STORE_FENCE off (the simulator's
        vLLM #45704), each (tier, item, source block)."""

    # --- executing one decision -----------------------------------------------------------------

    def execute(self, event: StoreJobStarted | LoadJobStarted | StateCopyPlanned) -> ReportRank:
        """Carry out one decision on the device and the tiers; the report to send for it."""
        self._catch_up_copies()
        try:
            with self.stream.ordered():
                if isinstance(event, StoreJobStarted):
                    checksums = self._store(event)
                elif isinstance(event, LoadJobStarted):
                    checksums = self._load(event)
                else:
                    execute_plan(self.pools.pool(event.pool_id), event.batches, event.scratch_bytes, pool_id=event.pool_id)
                    checksums = []
        except _Failed as failed:
            log.warning("job_failed_here", job_id=event.job_id, rank=self.rank, reason=failed.reason, error=str(failed))
            return ReportRank(
                job_id=event.job_id,
                rank=self.rank,
                ok=False,
                checksums=failed.checksums,
                error=f"{failed.reason}: {failed}",
                lost=failed.lost,
            )
        except (TransferError, TierError, CopyError) as error:
            reason = getattr(error, "reason", type(error).__name__)
            text = str(error)
            log.warning("job_failed_here", job_id=event.job_id, rank=self.rank, reason=reason, error=text)
            said = text if text.startswith(f"{reason}: ") else f"{reason}: {text}"  # a TierError says its reason first
            return ReportRank(job_id=event.job_id, rank=self.rank, ok=False, error=said)
        return ReportRank(job_id=event.job_id, rank=self.rank, ok=True, checksums=checksums)

    def _store(self, event: StoreJobStarted) -> list[bytes]:
        tier = self._tier(event.tier)
        naive = Protection.NULL_STATES in self.protections_off
        blocks = [self.pools.block(item.source, allow_null=naive) for item in event.items]  # all validated first
        if isinstance(tier, MooncakeTier) and self.rank == 0:  # what the slots held before: evicted, removed
            tier.retire((item.tier_slot, item.tier_generation - 1) for item in event.items)
        if Protection.STORE_FENCE in self.protections_off:
            # vLLM #45704: "done" once the copy is queued, with the checksum of the source as it
            # is now; the copy itself runs later (_catch_up_copies), from what the block holds then.
            self._unfenced += [(tier, item, block) for item, block in zip(event.items, blocks, strict=True)]
            return [checksum(block) for block in blocks]
        return [self._write(tier, item, block) for item, block in zip(event.items, blocks, strict=True)]

    def _catch_up_copies(self) -> None:
        """The unfenced store copies (STORE_FENCE off only) run now, before anything else."""
        unfenced, self._unfenced = self._unfenced, []
        for tier, item, block in unfenced:
            self._write(tier, item, block)

    def _load(self, event: LoadJobStarted) -> list[bytes]:
        tier = self._tier(event.tier)
        destinations = [self.pools.block(item.dest) for item in event.items]  # all validated first
        read: dict[bytes, tuple[torch.Tensor, bytes]] = {}
        gone: dict[bytes, str] = {}
        for item, dest in zip(event.items, destinations, strict=True):
            if item.key in read or item.key in gone:
                continue  # a duplicate key is read once (I11)
            try:
                key, generation = self._object(tier, item)
                data = tier.read(key, dest.numel(), slot=item.tier_slot, generation=generation)
            except TierError as error:
                if error.reason not in LOST:
                    raise
                if Protection.LOST_OBJECTS in self.protections_off:
                    # A connector that copies what the get returned (nothing): the destination
                    # keeps what it held, and that is what it reports having read.
                    read[item.key] = (dest.clone(), checksum(dest))
                    continue
                gone[item.key] = str(error)  # the tier lost the bytes: the key must leave it
                continue
            read[item.key] = (data, checksum(data))
        if gone:
            raise _Failed(
                "object_lost",
                "; ".join(gone.values()),
                [],
                [index for index, item in enumerate(event.items) if item.key in gone],
            )
        # I13. Off: seed 002's offload path with MOONCAKE_STORE_CHECKSUM unset (its default):
        # whatever the slot holds is copied, and its checksum reported as read.
        verify = Protection.CHECKSUMS not in self.protections_off
        mismatched = [
            index
            for index, item in enumerate(event.items)
            if verify and len(item.checksums) > self.rank and read[item.key][1] != item.checksums[self.rank]
        ]
        if mismatched:
            # Nothing is copied from bytes that are not what was published. The items before the
            # first such are (the coordinator keeps them loaded: JobFailed.kept), each verified
            # where it landed; the report carries what landed there and what was read after.
            first = mismatched[0]
            kept = list(zip(event.items[:first], destinations[:first], strict=True))
            for item, dest in kept:
                dest.copy_(read[item.key][0].view(dest.shape), non_blocking=True)
            if self.stream.stream is not None:
                self.stream.stream.synchronize()
            raise _Failed(
                "checksum_mismatch",
                f"keys {sorted({event.items[i].key.hex() for i in mismatched})} differ from their published checksums",
                [checksum(dest) for _, dest in kept] + [read[item.key][1] for item in event.items[first:]],
            )
        if Protection.LOAD_DEDUPE in self.protections_off:
            return self._load_naively(event, destinations, read)
        verified = []
        for item, dest in zip(event.items, destinations, strict=True):
            dest.copy_(read[item.key][0].view(dest.shape), non_blocking=True)
        if self.stream.stream is not None:
            self.stream.stream.synchronize()
        for item, dest in zip(event.items, destinations, strict=True):
            landed = checksum(dest)  # every destination, duplicates included (I11)
            if landed != read[item.key][1]:
                raise _Failed(
                    "verify_failed",
                    f"destination {item.dest} does not hold key {item.key.hex()}",
                    [checksum(d) for d in destinations],
                )
            verified.append(landed)
        return verified

    def _load_naively(
        self, event: LoadJobStarted, destinations: list[torch.Tensor], read: dict[bytes, tuple[torch.Tensor, bytes]]
    ) -> list[bytes]:
        """Seed 002's batch get with duplicate keys: only the first destination of a key is
        filled, and the read's checksum is reported for every item, none verified."""
        filled: set[bytes] = set()
        for item, dest in zip(event.items, destinations, strict=True):
            if item.key not in filled:
                dest.copy_(read[item.key][0].view(dest.shape))
                filled.add(item.key)
        return [read[item.key][1] for item in event.items]

    def _write(self, tier: Tier, item: StoreItem, block: torch.Tensor) -> bytes:
        key, generation = self._object(tier, item)
        return tier.write(key, block, slot=item.tier_slot, generation=generation)

    def _object(self, tier: Tier, item: StoreItem | LoadItem) -> tuple[bytes, int]:
        """The key and generation a tier call names. With OBJECT_GENERATIONS off (the
        simulator's mooncake-duplicate-put-keeps-first-value) a Mooncake object is named by its
        slot alone: every key the slot is given to puts to one name."""
        if Protection.OBJECT_GENERATIONS in self.protections_off and isinstance(tier, MooncakeTier):
            return b"", 0
        return item.key, item.tier_generation

    def _tier(self, name: str) -> Tier:
        tier = self.tiers.get(name)
        if tier is None:
            raise TransferError("unknown_tier", f"this worker has no tier {name!r} (tiers: {sorted(self.tiers)})")
        return tier

    # --- the loop -------------------------------------------------------------------------------

    async def run(self, client: WorkerClient, *, stop_after: Callable[[Decision], bool] | None = None) -> None:
        """Execute every committed decision for this rank after the acknowledged one, forever
        (or until `stop_after(decision)` says so)."""
        if self.state.pending is not None:
            await self._send(client, self.state.pending)  # a report saved before a crash
        async for decision in client.decisions(self.state.acked):
            if decision.seq <= self.state.acked:
                continue
            report = await anyio.to_thread.run_sync(self.execute, decision.event)
            self.executed.append(decision.seq)
            pending = Pending(decision.seq, report)
            self._save(WorkerState(acked=self.state.acked, pending=pending))
            await self._send(client, pending)
            if stop_after is not None and stop_after(decision):
                return

    async def _send(self, client: WorkerClient, pending: Pending) -> None:
        # The command id makes a re-sent report return the committed one.
        command_id = f"report/{self.engine_id}/{self.rank}/{pending.seq}"
        committed = await client.report(pending.report, command_id=command_id)
        self._save(WorkerState(acked=pending.seq))
        log.info(
            "reported",
            engine=self.engine_id,
            rank=self.rank,
            seq=pending.seq,
            job_id=pending.report.job_id,
            ok=pending.report.ok,
            duplicate=committed.duplicate,
            command_id=command_id,
            first_seq=committed.first_seq,
            last_seq=committed.last_seq,
        )

    def _load_state(self) -> WorkerState:
        if self.state_path is None or not self.state_path.exists():
            return WorkerState()
        return msgspec.json.decode(self.state_path.read_bytes(), type=WorkerState)

    def _save(self, state: WorkerState) -> None:
        self.state = state
        if self.state_path is None:
            return
        temporary = self.state_path.with_name(self.state_path.name + ".tmp")
        with open(temporary, "wb") as handle:
            handle.write(msgspec.json.encode(state))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.state_path)


class _Failed(Exception):
    """A load that must be reported as failed with what was read (the coordinator quarantines)."""

    def __init__(self, reason: str, message: str, checksums: list[bytes], lost: list[int] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.checksums = checksums
        self.lost = lost or []
        """Items whose bytes the tier no longer holds (ReportRank.lost)."""
