"""Driving an external-keys engine (vLLM's offloading: it owns its device blocks and names its
own keys) on the real pure core: its stores, reports, lookups and loads."""

from __future__ import annotations

from coordinator.core import CoordinatorCore
from coordinator.core.commands import ExternalKey, LoadExternal, LookupExternal, ReportRank, StoreExternal
from events import Event, ExternalKeysLookedUp, ExternalLoadStarted, ExternalStoreStarted
from tests.kit.builders import ENGINE, TIER, attention_pool, begin, new_core, ok

WORLD = 2


def vllm_key(n: int, group: int = 0) -> bytes:
    """A key shaped like vLLM's offload key: a 32-byte block hash, then the group, 4 bytes."""
    return bytes([n]) * 32 + group.to_bytes(4, "big")


def refs(*numbers: int) -> list[ExternalKey]:
    return [ExternalKey(0, vllm_key(n)) for n in numbers]


def core_with(
    tier_slots: int = 8, engine_id: str = ENGINE, core: CoordinatorCore | None = None, **namespace_fields: object
) -> CoordinatorCore:
    """An engine whose pool 0 is reported (vLLM owns its GPU blocks), in an open step."""
    core = new_core([attention_pool(managed=False)], world_size=WORLD, tier_slots=tier_slots, engine_id=engine_id, core=core)
    begin(core, engine_id=engine_id)
    return core


def sums(job: ExternalStoreStarted | ExternalLoadStarted, rank: int) -> list[bytes]:
    """What an honest worker reports: the checksum of the bytes of each key on its rank."""
    return [b"sum:" + item.key[:6] + bytes([rank]) for item in job.items]


def store(core: CoordinatorCore, *numbers: int, engine_id: str = ENGINE) -> ExternalStoreStarted:
    events = ok(core.execute(StoreExternal(engine_id=engine_id, tier=TIER, keys=refs(*numbers))))
    (job,) = [e for e in events if isinstance(e, ExternalStoreStarted)]
    return job


def report(
    core: CoordinatorCore,
    job: ExternalStoreStarted | ExternalLoadStarted,
    rank: int,
    *,
    ok_: bool = True,
    checksums: list[bytes] | None = None,
) -> list[Event]:
    return core.execute(
        ReportRank(job_id=job.job_id, rank=rank, ok=ok_, checksums=sums(job, rank) if checksums is None else checksums)
    )


def publish(core: CoordinatorCore, *numbers: int, engine_id: str = ENGINE) -> ExternalStoreStarted:
    job = store(core, *numbers, engine_id=engine_id)
    for rank in range(WORLD):
        report(core, job, rank)
    return job


def loadable(core: CoordinatorCore, *numbers: int, engine_id: str = ENGINE) -> list[bool]:
    (event,) = ok(core.execute(LookupExternal(engine_id=engine_id, tier=TIER, keys=refs(*numbers))))
    assert isinstance(event, ExternalKeysLookedUp)
    return event.loadable


def load(core: CoordinatorCore, *numbers: int, lease_seconds: float = 30.0) -> ExternalLoadStarted:
    (event,) = ok(core.execute(LoadExternal(engine_id=ENGINE, tier=TIER, keys=refs(*numbers), lease_seconds=lease_seconds)))
    assert isinstance(event, ExternalLoadStarted)
    return event
