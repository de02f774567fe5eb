"""The Mooncake tier (gpu/mooncake.py) on a real Mooncake Store master (tests/kit/mooncake.py):
what a Mooncake Store does, and what kvledger's tier makes of it, with real workers and a real
sidecar (the simulator's harness) where the engines' bytes are checked against recompute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from coordinator.audit.verify_run import VerifyReport, verify_log
from coordinator.client import Address, EngineClient
from coordinator.core.commands import AllocateBlocks, DeclareEngine, LoadRequest, MarkComputed, StartLoad, StartOwner, StartStore
from coordinator.simulator.harness import CPU, TIER, SimEngine, Simulation, Tally
from coordinator.simulator.report import ALL_SCENARIOS
from coordinator.simulator.reported import MOONCAKE
from coordinator.simulator.scenarios import Outcome, admit, attention, load_prefix, namespace, produce, prompt, run_scenario
from events import (
    BlockRef,
    BlocksAllocated,
    Event,
    EventCodec,
    JobFailed,
    JobSucceeded,
    KeyQuarantined,
    LoadItem,
    LoadJobStarted,
    OwnerStarted,
    PrefixLookedUp,
    RankReported,
    StoreJobStarted,
    TierSpec,
)
from events.log import open_log
from events.log.reading import decode
from gpu import mooncake
from gpu.checksum import checksum
from gpu.mooncake import MooncakeTier, SegmentHolder
from gpu.pools import DevicePools
from gpu.tiers import TierError
from gpu.worker import Worker
from tests.conftest import KAFKA_FETCH_WAIT_MS
from tests.kit.kafka import KafkaBroker
from tests.kit.mooncake import MooncakeMaster
from tests.kit.sidecar import ROOT, Engine, ServeProcess


@pytest.fixture(scope="module")
def store(mooncake_master: MooncakeMaster) -> Any:
    client = mooncake.connect(mooncake_master.address, mooncake_master.metadata_url)
    yield client
    client.close()


def _tier(store: Any, rank: int = 0) -> MooncakeTier:
    return MooncakeTier(TIER, store, rank=rank, device=CPU)


def test_a_put_of_an_existing_name_keeps_the_first_value_and_a_new_generation_is_a_new_object(store: Any) -> None:
    """Mooncake's rule, seen here: a second put of a name returns 0 and keeps the first bytes,
    even of another size. The tier names each object by the slot's generation too, so a key
    stored again after its slot was reused (a new generation) reads back what was stored last."""
    name = "kvledger-test/keep-first"
    assert store.put(name, b"first" * 10) == 0
    assert store.put(name, b"second") == 0
    assert store.get(name) == b"first" * 10

    tier = _tier(store)
    key = bytes(range(16))
    old, new = torch.full((64,), 1, dtype=torch.uint8), torch.full((64,), 2, dtype=torch.uint8)
    tier.write(key, old, slot=5, generation=1)
    tier.write(key, new, slot=5, generation=2)
    assert torch.equal(tier.read(key, 64, slot=5, generation=2), new)
    assert torch.equal(tier.read(key, 64, slot=5, generation=1), old)
    assert tier.object_name(key, 5, 2) == f"kvledger/{TIER}/5/2/{key.hex()}/0"


def test_a_missing_or_short_object_is_a_tier_error_naming_it(store: Any) -> None:
    tier = _tier(store, rank=1)
    key = b"\x07" * 16
    with pytest.raises(TierError) as missing:
        tier.read(key, 64, slot=1, generation=1)
    assert missing.value.reason == "missing" and tier.object_name(key, 1, 1) in str(missing.value)
    tier.write(key, torch.zeros(32, dtype=torch.uint8), slot=1, generation=1)
    with pytest.raises(TierError) as short:
        tier.read(key, 64, slot=1, generation=1)
    assert short.value.reason == "truncated"


def test_retiring_a_slots_generation_removes_every_ranks_object_of_it_and_nothing_else(store: Any) -> None:
    """What a store job's rank 0 does before it writes (gpu.worker): the objects of each slot's
    previous generation go, every rank's, in one call, forced (a get's lease would refuse an
    unforced remove); the slot's new generation, other slots and other tiers stay. The tier's name
    is vLLM's kind (punctuation the master's regex must take literally)."""
    name = "vllm-mooncake:127.0.0.1:1"
    tiers = [MooncakeTier(name, store, rank=rank, device=CPU) for rank in (0, 1)]
    lookalike = MooncakeTier("vllm-mooncake:127x0.0.1:1", store, rank=0, device=CPU)
    key, other = b"\x01" * 16, b"\x02" * 16
    block = torch.arange(64, dtype=torch.uint8)
    for tier in tiers:
        tier.write(key, block, slot=3, generation=1)
        tier.write(other, block, slot=3, generation=2)
        tier.write(key, block, slot=13, generation=1)
    lookalike.write(key, block, slot=3, generation=1)
    tiers[0].read(key, 64, slot=3, generation=1)  # a get: Mooncake's own lease on the object
    assert tiers[0].retire([(3, 1), (7, 0)]) == 2
    gone = [tier.object_name(key, 3, 1) for tier in tiers]
    kept = [tier.object_name(other, 3, 2) for tier in tiers] + [tier.object_name(key, 13, 1) for tier in tiers]
    assert [store.is_exist(n) for n in gone] == [0, 0]
    assert [store.is_exist(n) for n in kept] == [1] * 4 and store.is_exist(lookalike.object_name(key, 3, 1)) == 1


def test_kvledgers_evictions_remove_the_evicted_keys_objects_when_their_slots_are_given_out_again(
    store: Any, tmp_path: Path
) -> None:
    """Issue 21, item 1: a tier of 2 slots, three prompts of 2 blocks stored in turn: each store
    evicts the prompt before (LRU), and its objects leave the Mooncake Store (every rank's) as
    the new keys are written; what is published is there and loads, verified."""

    async def run() -> tuple[list[list[str]], Tally]:
        async with Simulation(tmp_path, frozenset(), tier_slots=2, tier=lambda rank: _tier(store, rank)) as sim:
            engine = await sim.engine("pod-a", namespace(), [attention()])
            names = []
            for index in range(3):
                stored = await produce(engine, f"r{index}", prompt(40 + index, 2))
                names.append(
                    [
                        _tier(store, rank).object_name(i.key, i.tier_slot, i.tier_generation)
                        for i in stored.items
                        for rank in (0, 1)
                    ]
                )
            reader = await admit(engine, "reader")
            assert await load_prefix(engine, reader, [item.key for item in stored.items], prompt(42, 2))
            return names, sim.tally

    names, tally = anyio.run(run)
    assert [[store.is_exist(name) for name in prompt_names] for prompt_names in names] == [[0] * 4, [0] * 4, [1] * 4]
    assert tally.loads_checked == 2 and tally.wrong_reads == 0, tally


def _simulation(directory: Path, store: Any) -> Simulation:
    return Simulation(directory, frozenset(), tier=lambda rank: _tier(store, rank))


def test_a_prompt_one_engine_stored_in_mooncake_is_loaded_verified_by_another(store: Any, tmp_path: Path) -> None:
    """Two engines (each with two worker ranks) share the Mooncake tier through one sidecar:
    pod-b loads what pod-a published, every rank's shard checked against the published checksum
    and then against recompute."""

    async def run() -> tuple[Tally, list[str]]:
        async with _simulation(tmp_path, store) as sim:
            a = await sim.engine("pod-a", namespace(), [attention()])
            b = await sim.engine("pod-b", namespace(), [attention()])
            tokens = prompt(1, 2)
            stored = await produce(a, "a-1", tokens)
            reader = await admit(b, "b-1")
            assert await load_prefix(b, reader, [item.key for item in stored.items], tokens)
            names = [
                _tier(store, rank).object_name(item.key, item.tier_slot, item.tier_generation)
                for item in stored.items
                for rank in (0, 1)
            ]
            return sim.tally, names

    tally, names = anyio.run(run)
    assert tally.loads_checked == 2 and tally.wrong_reads == 0 and not tally.refusals, tally
    assert all(store.is_exist(name) == 1 for name in names)


def test_two_sidecars_on_one_kafka_log_share_the_mooncake_tier_publications_leases_and_slots(
    store: Any, kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    """Issue 21, item 2, the fleet case: two sidecars, each with its own state store, write one
    Kafka topic (a real broker); engine pod-a (two worker ranks) on the first, pod-b on the second,
    both on the one Mooncake Store. What pod-a publishes, pod-b's sidecar folds in from the log
    (its follower): a lookup there finds it, and pod-b loads it, verified against the published
    checksums and recompute. Then both store at once into a tier of 8 slots: every append names
    the head it was decided on, so a group decided before the other sidecar's append is decided
    again on top of it; no slot is given twice at one generation, and `kvledger verify` finds
    nothing in the fleet's log."""
    topic = f"kvl-fleet-{tmp_path.name[-12:]}"

    def url(state: str) -> str:
        return kafka_broker.url(topic, state=tmp_path / state, fetch_wait_ms=KAFKA_FETCH_WAIT_MS)

    async def run() -> tuple[Tally, Tally, int, list[int]]:
        mooncake_tier = lambda rank: _tier(store, rank)  # noqa: E731 - the factory each Simulation calls per rank
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        async with (
            Simulation(tmp_path / "a", frozenset(), tier_slots=8, tier=mooncake_tier, log_url=url("a.sqlite")) as first,
            Simulation(tmp_path / "b", frozenset(), tier_slots=8, tier=mooncake_tier, log_url=url("b.sqlite")) as second,
        ):
            a = await first.engine("pod-a", namespace(), [attention()])
            b = await second.engine("pod-b", namespace(), [attention()])
            tokens = prompt(50, 2)
            stored = await produce(a, "a-1", tokens)
            with anyio.fail_after(20):  # the second sidecar's follower folds pod-a's steps in
                while True:
                    hit = await b.client.lookup(TIER, tokens)
                    assert isinstance(hit.answer, PrefixLookedUp)
                    if hit.answer.boundary > 0:
                        break
                    await anyio.sleep(0.05)
            reader = await admit(b, "b-1")
            assert await load_prefix(b, reader, [item.key for item in stored.items], tokens)

            async def stores(engine: SimEngine, seeds: range) -> None:
                for seed in seeds:
                    await produce(engine, f"{engine.engine_id}-{seed}", prompt(seed, 2))

            async with anyio.create_task_group() as both:  # 12 keys into 8 slots, from both sidecars at once
                both.start_soon(stores, a, range(60, 63))
                both.start_soon(stores, b, range(70, 73))
            assert first.sidecar is not None and second.sidecar is not None
            moved = [int(s.metrics.head_moved._value.get()) for s in (first.sidecar, second.sidecar)]
            head = first.sidecar.ledger.last_seq
        fleet = await open_log(url("reader.sqlite"))
        try:
            verified = await verify_log(fleet)
            assert verified.ok and not verified.violations, verified.violations
            events = [decode(EventCodec(), stored) for stored in await fleet.read(0, 100_000)]
        finally:
            await fleet.close()
        reserved = [(i.tier_slot, i.tier_generation) for e in events if isinstance(e, StoreJobStarted) for i in e.items]
        assert len(reserved) == len(set(reserved)) == 14, reserved  # 7 prompts of 2 blocks, no (slot, generation) twice
        return first.tally, second.tally, head, moved

    tally_a, tally_b, head, moved = anyio.run(run)
    assert tally_b.loads_checked == 2 and tally_b.wrong_reads == 0 and tally_a.wrong_reads == 0, (tally_a, tally_b)
    assert not tally_a.refusals and not tally_b.refusals, (tally_a.refusals, tally_b.refusals)
    print(f"fleet on one topic: head {head}, groups decided again after the other's append {moved}")


@pytest.mark.timeout(240)
def test_engines_on_two_serve_processes_of_one_kafka_topic_with_worker_processes_share_one_mooncake_store(
    mooncake_master: MooncakeMaster, kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    """Issue 21, item 2, every part a process of its own: two `kvledger serve` processes on one
    Kafka topic, a `kvledger worker` process for each engine (its Mooncake client, its engine's
    pools mapped from files), one Mooncake master. pod-a's blocks, stored through the first
    sidecar, are found by a lookup on the second (its follower folded them in) and loaded by
    pod-b's worker into pod-b's blocks, byte for byte, verified against the published checksum;
    the topic verifies clean. On a master of its own: the worker processes are killed at the end,
    and a dead client's segment takes the master's later puts for ~10 s (-800)."""
    topic = f"kvl-fleet-proc-{tmp_path.name[-10:]}"
    master = MooncakeMaster.start(tmp_path)  # the session's (mooncake_master) says whether there is a Mooncake
    tier = f"{TIER}=mooncake:{master.address},{master.metadata_url}"
    specs = [attention(num_blocks=8)]
    servers: list[ServeProcess] = []
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            url = kafka_broker.url(topic, state=tmp_path / name / "state.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS)
            servers.append(ServeProcess(tmp_path / name, log=url))
            servers[-1].start(timeout=60)

        def declare(name: str) -> DeclareEngine:
            return DeclareEngine(engine_id=f"pod-{name}", namespace=namespace(tp=1), pools=specs, world_size=1, tiers=[TIER])

        async def admitted(engine: Engine, engine_id: str) -> tuple[int, list[BlockRef]]:
            """A request of `engine_id`, given two blocks: (its owner, the blocks)."""
            started = await engine.step([StartOwner(engine_id=engine_id, req_id=f"{engine_id}-1")])
            owner = next(e.owner_id for e in started.results[0] if isinstance(e, OwnerStarted))
            allocated = await engine.step([AllocateBlocks(engine_id=engine_id, owner_id=owner, pool_id=0, count=2)])
            return owner, next(e.blocks for e in allocated.results[0] if isinstance(e, BlocksAllocated))

        async def scenario() -> tuple[list[bytes], torch.Tensor, torch.Tensor]:
            tier_spec = TierSpec(name=TIER, num_slots=16, bytes_per_slot=1 << 20)
            clients = [
                EngineClient(Address(socket_path=str(server.socket)), declare(name), tiers=[tier_spec])
                for server, name in zip(servers, "ab", strict=True)
            ]
            async with clients[0], clients[1]:
                a, b_ = (Engine(client) for client in clients)
                for server, name in zip(servers, "ab", strict=True):
                    command = [sys.executable, "-m", "coordinator.cli", "worker", "--engine", f"pod-{name}", "--rank", "0"]
                    command += ["--socket", str(server.socket), "--tier", tier, "--state-dir", str(tmp_path / name)]
                    command += ["--pools-dir", str(tmp_path / name / "pools")]
                    output = open(tmp_path / name / "worker.log", "wb")  # noqa: SIM115 - the child keeps it
                    workers.append(subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=output))
                    output.close()
                memory = [DevicePools(specs, CPU, directory=tmp_path / name / "pools") for name in "ab"]
                tokens = prompt(60, 2)
                owner, blocks = await admitted(a, "pod-a")
                for index, ref in enumerate(blocks):  # pod-a's forward pass
                    memory[0].block(ref).copy_(torch.full((memory[0].block(ref).numel(),), 17 + index, dtype=torch.uint8))
                stored = await a.step(
                    [
                        MarkComputed(engine_id="pod-a", owner_id=owner, blocks=blocks, token_ids=tokens),
                        StartStore(engine_id="pod-a", tier=TIER, blocks=blocks),
                    ]
                )
                [decision] = stored.decisions
                assert isinstance(decision.event, StoreJobStarted)
                keys = [item.key for item in decision.event.items]
                with anyio.fail_after(90):  # pod-a's worker stored and reported; the second sidecar folded it in
                    while True:
                        hit = await clients[1].lookup(TIER, tokens)
                        assert isinstance(hit.answer, PrefixLookedUp)
                        if hit.answer.boundary == len(tokens):
                            break
                        await anyio.sleep(0.1)
                _, dests = await admitted(b_, "pod-b")
                await b_.step(
                    [StartLoad(engine_id="pod-b", tier=TIER, items=[LoadRequest(k, d) for k, d in zip(keys, dests, strict=True)])]
                )
                expected = torch.stack([memory[0].block(ref).clone() for ref in blocks])
                with anyio.fail_after(90):  # pod-b's worker loads from the store into pod-b's blocks
                    while not torch.equal(torch.stack([memory[1].block(ref) for ref in dests]), expected):
                        await anyio.sleep(0.1)
                return keys, expected, torch.stack([memory[1].block(ref).clone() for ref in dests])

        keys, expected, loaded = anyio.run(scenario)
        assert torch.equal(loaded, expected) and int(expected[1, 0]) == 18

        async def read_back() -> tuple[list[Event], VerifyReport]:
            fleet = await open_log(kafka_broker.url(topic, state=tmp_path / "reader.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS))
            try:
                with anyio.fail_after(60):
                    while True:  # pod-b's report may still be on its way
                        events = [decode(EventCodec(), stored) for stored in await fleet.read(0, 100_000)]
                        loading = {e.job_id for e in events if isinstance(e, LoadJobStarted)}
                        if [e for e in events if isinstance(e, JobSucceeded) and e.job_id in loading]:
                            break
                        await anyio.sleep(0.2)
                return events, await verify_log(fleet)
            finally:
                await fleet.close()

        events, verified = anyio.run(read_back)
        assert verified.ok and not verified.violations, verified.violations
        loads = [e for e in events if isinstance(e, LoadJobStarted)]
        assert [item.key for item in loads[0].items] == keys and loads[0].engine_id == "pod-b"
        assert not [e for e in events if isinstance(e, JobFailed | KeyQuarantined)]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
        for server in servers:
            server.kill()
        master.stop()


def test_an_object_the_store_lost_is_a_failed_load_naming_it_and_the_engine_recomputes(store: Any, tmp_path: Path) -> None:
    """Mooncake evicts on its own, with no notice: here the objects of a published key are
    removed behind kvledger's back. The load fails on every rank (the report names the object
    Mooncake has no value for, and the items it lost); the keys leave kvledger's tier, so a
    lookup no longer offers them; the engine recomputes; nothing wrong is read."""

    async def run() -> tuple[Tally, list[str]]:
        async with _simulation(tmp_path, store) as sim:
            engine = await sim.engine("pod-a", namespace(), [attention()])
            tokens = prompt(2, 2)
            stored = await produce(engine, "r1", tokens)
            for item in stored.items:
                for rank in (0, 1):
                    assert store.remove(_tier(store, rank).object_name(item.key, item.tier_slot, item.tier_generation), True) == 0
            reader = await admit(engine, "r2")
            await load_prefix(engine, reader, [item.key for item in stored.items], tokens)
            hit = await engine.client.lookup(TIER, tokens)  # the sidecar still serves, and offers nothing lost
            assert isinstance(hit.answer, PrefixLookedUp) and hit.answer.boundary == 0
        event_log = await open_log(str(sim.log_path))
        try:
            events = [decode(EventCodec(), stored) for stored in await event_log.read(0, 10_000)]
            errors = [e.error for e in events if isinstance(e, RankReported) and not e.ok]
            verified = await verify_log(event_log)  # the lost keys' evictions keep every invariant
            assert verified.ok and not verified.violations, verified.violations
        finally:
            await event_log.close()
        return sim.tally, errors

    tally, errors = anyio.run(run)
    assert tally.wrong_reads == 0 and tally.loads_checked == 0, tally  # nothing used from the load: recomputed
    assert tally.refusals == {"JobFailed:object_lost": 1}, tally.refusals
    assert len(errors) == 2 and all(
        error.startswith("object_lost: missing: Mooncake has no value for kvledger/") for error in errors
    )


def test_objects_in_a_killed_clients_segment_are_a_failed_load_naming_them_never_a_crash(
    mooncake_master: MooncakeMaster, tmp_path: Path
) -> None:
    """Mooncake, seen here: after the client whose segment holds objects is killed (SIGKILL),
    `is_exist` still says 1 while `get` returns nothing, for ~10 s. Another engine's worker that
    loads those keys reports the load failed, naming each object and the items lost (so the keys
    leave kvledger's tier), and goes on. On a master of its own: a dead client leaves the
    master slow to answer for a while, which the other tests need not share."""
    master = MooncakeMaster.start(tmp_path)
    store = mooncake.connect(master.address, master.metadata_url)
    key_a, key_b = b"\x0a" * 16, b"\x0b" * 16
    block = torch.arange(256, dtype=torch.uint8)
    tier = _tier(store)
    names = [tier.object_name(key, slot, 3) for slot, key in enumerate((key_a, key_b))]
    holder = SegmentHolder.start(master.address, master.metadata_url)  # another process's client
    try:
        tier.preferred_segment = holder.segment  # the objects in its segment
        for slot, key in enumerate((key_a, key_b)):
            tier.write(key, block, slot=slot, generation=3)
        assert [len(store.get(name)) for name in names] == [256, 256]
    finally:
        tier.preferred_segment = None
        holder.kill()
    assert [store.is_exist(name) for name in names] == [1, 1]  # the master still says they exist
    worker = Worker("pod-b", 0, DevicePools([attention()], CPU), {TIER: _tier(store)})
    published = checksum(block)
    load = LoadJobStarted(
        job_id=7,
        engine_id="pod-b",
        incarnation=1,
        tier=TIER,
        world_size=1,
        items=[LoadItem(key, slot, 3, BlockRef(0, 1 + slot, 1), [published]) for slot, key in enumerate((key_a, key_b))],
        lease_expires_at=1e9,
    )
    try:
        report = worker.execute(load)
    finally:
        store.close()
        master.stop()
    assert not report.ok and report.lost == [0, 1], report
    assert report.error.startswith("object_lost: missing: ") and all(name in report.error for name in names)


@pytest.mark.parametrize("name", sorted(MOONCAKE))
def test_each_mooncake_scenario_bites_off_and_is_prevented_on_and_verify_finds_the_off_incident(
    name: str, mooncake_master: MooncakeMaster, tmp_path: Path
) -> None:
    """The Mooncake Store's silent failures as fault scenarios, on a real store (a master of
    each scenario's own: a killed client leaves a master slow for a while): protection off,
    wrong-KV reads counted from the bytes; on, none, and what kvledger recorded instead; the
    off run's log shows the incident to `kvledger verify`, the on run's shows nothing but what the
    baseline lets through."""
    scenario = MOONCAKE[name]
    master = MooncakeMaster.start(tmp_path)  # the session's (mooncake_master) says whether there is a Mooncake
    store = mooncake.connect(master.address, master.metadata_url)

    def tier(rank: int) -> MooncakeTier:
        return MooncakeTier(TIER, store, rank=rank, device=CPU, master=master.address, metadata_url=master.metadata_url)

    async def run(protection_on: bool) -> tuple[Outcome, VerifyReport]:
        where = tmp_path / ("on" if protection_on else "off")
        where.mkdir()
        outcome = await run_scenario(scenario, protection_on=protection_on, directory=where, tier=tier)
        event_log = await open_log(outcome.log)
        try:
            return outcome, await verify_log(event_log)
        finally:
            await event_log.close()

    try:
        on, verified_on = anyio.run(run, True)
        off, verified_off = anyio.run(run, False)
    finally:
        store.close()
        master.stop()
    print(f"{name}: off {off.wrong_reads} wrong reads {off.refusals}; on {on.wrong_reads} wrong reads {on.refusals}")
    assert off.wrong_reads > 0, off
    assert on.wrong_reads == 0, on
    if scenario.evidence:
        assert scenario.evidence in on.refusals and scenario.evidence not in off.refusals, (on.refusals, off.refusals)
    else:  # nothing wrong left to refuse: the on run reads the right bytes
        assert not on.refusals and on.loads_checked > 0, on
    assert off.protections_off == sorted([*on.protections_off, scenario.protection.value])
    allowed = {ALL_SCENARIOS[p.value].invariant for p in scenario.baseline}
    assert {v.invariant for v in verified_on.violations} <= allowed, verified_on.violations
    assert scenario.invariant in {v.invariant for v in verified_off.violations}, verified_off.violations
