"""Stateful property test: random command sequences against the real CoordinatorCore.

One engine (world size 2) with a hybrid layout: a small attention pool (0), a small state pool
(1), a 4-slot host tier (so stores evict) and an 8-token encoder cache. Rules allocate under
pressure, preempt and resume (same req_id, new owner), compute, store, load (duplicate keys
included, I11), copy state, look up prefixes, reset or restart (another weights revision too),
free and re-allocate encoder entries in one step, let the clock jump past leases, report job
ranks one at a time in random order (duplicate, conflicting, tampered and late reports
included) and send deliberately bad commands. Hypothesis switches rules off at random per run
(swarm testing), so the rules that need a step or an owner start one themselves.

The test keeps its own record of every job and the first report of each rank, and checks each
job's outcome against it: stores publish only when every rank succeeded with checksums (I5),
re-stores are no-ops or quarantines (I10), loads fail on an expired lease, an evicted or
quarantined key, or a checksum mismatch, which quarantines the key (I12, I13).

After every rule the invariants below are checked on `core.state`:

* I2 / I3: block 0 is in no list; no pinned or referenced slot is free or cached; idle slots are
  in exactly one list (nothing leaks); refs and pins equal what owners and in-flight jobs hold.
* I1: generations only grow (device pools and tier slots).
* I4 / I16: the jobs in flight are exactly the ones this test started and has not completed or
  fenced.
* I5 / I2: every published key comes from a store job whose every rank reported success with a
  checksum, from a real (non-null) block, with one checksum per rank (in the state and in every
  KeyPublished event).
* I18: replaying every emitted event from an empty state gives the live state, byte for byte.

No Python exception may escape `core.execute`: the decider answers bad input with events, and a
refusal or dropped notice is one event that leaves the state unchanged.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from coordinator.core.commands import (
    AllocateBlocks,
    FinishOwner,
    Move,
    PlanStateCopy,
)
from events import (
    BlocksAllocated,
)
from tests.kit.builders import (
    ENGINE,
    allocate,
    attention_pool,
    begin,
    compute,
    new_core,
    ok,
    owner,
    state_pool,
)
from tests.kit.machine import ATTENTION, DOCS, ENCODER_TOKENS, POOL_BLOCKS, STATE
from tests.kit.machine_invariants import Invariants
from tests.kit.machine_rules_bad import BadCommandRules
from tests.kit.machine_rules_blocks import BlockRules
from tests.kit.machine_rules_jobs import JobRules


class CoordinatorMachine(BlockRules, JobRules, BadCommandRules, Invariants):
    """Every rule and every invariant: tests/kit/machine_rules_*.py and tests/kit/machine_invariants.py."""


# Shrinking a failing 60-step run can take Hypothesis minutes (its own cap is 300 s, equal to
# pyproject's default pytest timeout): give this module room so a failure reports its shrunk
# example instead of a timeout.
pytestmark = pytest.mark.timeout(900)

CoordinatorMachine.TestCase.settings = settings(
    max_examples=100,  # a passing run takes ~10 s; 60 examples sometimes miss a 7-step bug
    stateful_step_count=60,
    deadline=None,
    report_multiple_bugs=False,  # one bug, shrunk, is what a reader needs
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoordinatorStateMachine = CoordinatorMachine.TestCase


# --- regressions found by the machine, pinned down as plain tests ----------------------------


def test_state_copy_from_a_cached_free_slot_keeps_it_out_of_the_free_lists() -> None:
    """I3: a copy may read a cached-free slot (status is not FREE), which pins it; the pinned
    slot must then leave `pool.cached`, or the next allocation hands it to a new owner while
    the copy still reads it."""
    core = new_core(
        [attention_pool(ATTENTION, POOL_BLOCKS[ATTENTION]), state_pool(STATE, POOL_BLOCKS[STATE])],
        encoder_cache_tokens=ENCODER_TOKENS,
    )
    begin(core)
    first = owner(core, "req-1")
    [source] = allocate(core, first, 1, STATE)
    compute(core, first, [source], DOCS[0][:8])
    ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=first)))  # source is cached-free now
    second = owner(core, "req-2")
    [dest] = allocate(core, second, 1, STATE)
    ok(core.execute(PlanStateCopy(engine_id=ENGINE, pool_id=STATE, moves=[Move(source, 0, dest, 0, 64)])))
    pool = core.state.engines[ENGINE].pools[STATE]
    assert pool.pins[source.block_id] == 1
    assert source.block_id not in pool.cached and source.block_id not in pool.free, (
        "a slot pinned by a state copy is still listed as cached-free (I3)"
    )
    third = owner(core, "req-3")
    events = core.execute(AllocateBlocks(engine_id=ENGINE, owner_id=third, pool_id=STATE, count=2))
    allocated = [ref.block_id for e in events if isinstance(e, BlocksAllocated) for ref in e.blocks]
    assert source.block_id not in allocated, "a slot pinned by a state copy in flight was reallocated (I3)"
