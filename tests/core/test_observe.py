"""Observed engines on the pure core (coordinator/core/observe.py): what vLLM says it stored and
removed is recorded per incarnation, medium and group; duplicates, impossible parent chains,
unknown hashes and types, mismatched block sizes and unreadable frames are refusals that leave
the state unchanged while the rest of the batch is recorded (I18 holds throughout)."""

from __future__ import annotations

import msgspec
import pytest

from coordinator.core import CoordinatorCore
from coordinator.core.commands import ObservedKvEvent, ObserveEngine, ObserveGap, ObserveKvEvents, ObserveMalformed
from coordinator.core.observe import MAX_SOURCE_SEQ
from coordinator.core.projector import project
from coordinator.core.state import State, decode_state, encode_state, state_digest
from events import (
    EngineObserved,
    Event,
    NamespaceRegistered,
    ObservedBatch,
    ObservedBlocksRemoved,
    ObservedBlocksStored,
    ObservedCacheCleared,
    ObservedEventsMissed,
    Reason,
    Refused,
)
from tests.kit import builders as b

ENGINE = "vllm-0"
BLOCK = 32
A, B, C, D = (bytes([n]) * 32 for n in (0xA1, 0xB2, 0xC3, 0xD4))


def observe(core: CoordinatorCore, reason: str = "first_seen", block_sizes: tuple[int, ...] = (BLOCK,)) -> list[Event]:
    return core.execute(
        ObserveEngine(engine_id=ENGINE, namespace=b.namespace(block_sizes=block_sizes, tp=1), source="test", reason=reason)
    )


def stored(
    *hashes: bytes, parent: bytes | None = None, medium: str = "GPU", group: int = 0, block_size: int = BLOCK
) -> ObservedKvEvent:
    return ObservedKvEvent(
        kind="stored",
        type_name="BlockStored",
        medium=medium,
        group=group,
        block_hashes=list(hashes),
        parent_hash=parent,
        token_ids=list(range(block_size * len(hashes))),
        block_size=block_size,
    )


def removed(*hashes: bytes, medium: str = "GPU", group: int = 0) -> ObservedKvEvent:
    return ObservedKvEvent(kind="removed", type_name="BlockRemoved", medium=medium, group=group, block_hashes=list(hashes))


def batch(core: CoordinatorCore, seq: int, *events: ObservedKvEvent) -> list[Event]:
    return core.execute(ObserveKvEvents(engine_id=ENGINE, seq=seq, ts=1000.0 + seq, dp_rank=0, events=list(events)))


def hashes(core: CoordinatorCore, place: str = "GPU/0") -> list[bytes]:
    return list(core.state.observed[ENGINE].stored.get(place, {}))


def unchanged(core: CoordinatorCore, before: bytes) -> bool:
    """The state is what `before` encodes, but for the count of events folded (a refusal is one)."""
    now = decode_state(encode_state(core.state))
    now.last_event = decode_state(before).last_event
    return encode_state(now) == before


def refusals(events: list[Event]) -> list[Refused]:
    return [e for e in events if isinstance(e, Refused)]


@pytest.fixture
def core() -> CoordinatorCore:
    core = CoordinatorCore()
    observe(core)
    return core


def test_first_sight_registers_the_namespace_and_incarnation_1() -> None:
    core = CoordinatorCore()
    events = observe(core)
    assert [type(e) for e in events] == [NamespaceRegistered, EngineObserved]
    observed = core.state.observed[ENGINE]
    assert (observed.incarnation, observed.next_seq, observed.complete, observed.stored) == (1, 0, True, {})


def test_stored_removed_and_cleared_are_recorded_with_the_incarnation(core: CoordinatorCore) -> None:
    events = batch(core, 0, stored(A, B), stored(C, parent=B), stored(D, medium="CPU"))
    assert [type(e) for e in events] == [ObservedBatch, ObservedBlocksStored, ObservedBlocksStored, ObservedBlocksStored]
    assert all(e.incarnation == 1 and e.source_seq == 0 for e in events if isinstance(e, ObservedBlocksStored))
    assert hashes(core) == [A, B, C] and hashes(core, "CPU/0") == [D]
    events = batch(core, 1, removed(B))
    assert isinstance(events[1], ObservedBlocksRemoved) and events[1].block_hashes == [B]
    assert hashes(core) == [A, C]
    events = batch(core, 2, ObservedKvEvent(kind="cleared", type_name="AllBlocksCleared"))
    assert isinstance(events[1], ObservedCacheCleared) and events[1].medium == "GPU"
    assert hashes(core) == [] and hashes(core, "CPU/0") == [D]  # a GPU reset leaves the CPU tier
    assert core.state.observed[ENGINE].next_seq == 3


def test_a_batch_at_or_below_the_last_recorded_is_refused_as_a_duplicate(core: CoordinatorCore) -> None:
    batch(core, 0, stored(A))
    before = encode_state(core.state)
    for seq in (0, -1):
        [refusal] = batch(core, seq, stored(B))
        assert isinstance(refusal, Refused)
        assert refusal.reason in (Reason.DUPLICATE_BATCH, Reason.INVALID_ARGUMENT)
    assert unchanged(core, before)


def test_an_empty_batch_still_moves_the_sequence_so_its_copy_is_a_duplicate(core: CoordinatorCore) -> None:
    batch(core, 0)
    [refusal] = batch(core, 0)
    assert isinstance(refusal, Refused) and refusal.reason == Reason.DUPLICATE_BATCH


def test_a_batch_beyond_the_next_one_records_the_missed_range_and_turns_the_checks_off(core: CoordinatorCore) -> None:
    batch(core, 0, stored(A))
    events = batch(core, 5, stored(C, parent=B), removed(D))
    missed = events[0]
    assert isinstance(missed, ObservedEventsMissed) and (missed.first_seq, missed.last_seq) == (1, 4)
    assert refusals(events) == []  # B and D may have been stored in 1..4
    observed = core.state.observed[ENGINE]
    assert not observed.complete and observed.next_seq == 6 and hashes(core) == [A, C]


def test_a_parent_that_is_not_stored_is_a_broken_chain_and_the_rest_of_the_batch_is_recorded(core: CoordinatorCore) -> None:
    batch(core, 0, stored(A))
    events = batch(core, 1, stored(C, parent=B), stored(B, parent=A), stored(D, parent=B))
    [refusal] = refusals(events)
    assert refusal.reason == Reason.BROKEN_PARENT_CHAIN and B.hex() in refusal.detail and "event 0" in refusal.detail
    assert refusal.command == "observe_kv_events" and refusal.engine_id == ENGINE
    assert hashes(core) == [A, B, D]  # C's chain was impossible; B then D chain on what is stored


def test_an_offload_tier_stores_without_its_parent(core: CoordinatorCore) -> None:
    events = batch(core, 0, stored(C, parent=B, medium="CPU"))
    assert refusals(events) == [] and hashes(core, "CPU/0") == [C]


def test_removing_a_hash_not_stored_is_refused_and_the_known_ones_are_removed(core: CoordinatorCore) -> None:
    batch(core, 0, stored(A, B))
    [refusal] = batch(core, 1, removed(C))[1:]
    assert isinstance(refusal, Refused) and refusal.reason == Reason.UNKNOWN_BLOCK_HASH and C.hex() in refusal.detail
    events = batch(core, 2, removed(A, D))
    assert [type(e) for e in events] == [ObservedBatch, ObservedBlocksRemoved, Refused]
    assert isinstance(events[1], ObservedBlocksRemoved) and events[1].block_hashes == [A]
    assert hashes(core) == [B]


def test_removal_in_another_group_is_not_a_removal_here(core: CoordinatorCore) -> None:
    core = CoordinatorCore()
    observe(core, block_sizes=(BLOCK, BLOCK))
    batch(core, 0, stored(A, group=0))
    [refusal] = refusals(batch(core, 1, removed(A, group=1)))
    assert refusal.reason == Reason.UNKNOWN_BLOCK_HASH and "GPU/1" in refusal.detail
    assert hashes(core) == [A]


def test_an_unknown_event_type_is_refused_naming_it(core: CoordinatorCore) -> None:
    events = batch(core, 0, ObservedKvEvent(kind="unknown", type_name="BlockTeleported"), stored(A))
    [refusal] = refusals(events)
    assert refusal.reason == Reason.UNKNOWN_EVENT_TYPE and "BlockTeleported" in refusal.detail
    assert hashes(core) == [A]


def test_a_malformed_event_is_refused_and_the_rest_recorded(core: CoordinatorCore) -> None:
    events = batch(
        core,
        0,
        ObservedKvEvent(kind="malformed", type_name="BlockStored", detail="no block_hashes"),
        stored(A),
        stored(block_size=BLOCK),
        removed(bytes(200)),
    )
    assert [r.reason for r in refusals(events)] == [Reason.MALFORMED_EVENT] * 3
    assert "no block_hashes" in refusals(events)[0].detail
    assert hashes(core) == [A]


def test_a_block_size_other_than_the_namespace_is_refused_naming_both(core: CoordinatorCore) -> None:
    [refusal] = refusals(batch(core, 0, stored(A, block_size=16)))
    assert refusal.reason == Reason.NAMESPACE_MISMATCH and "16" in refusal.detail and str(BLOCK) in refusal.detail
    [refusal] = refusals(batch(core, 1, stored(A, group=3)))
    assert refusal.reason == Reason.NAMESPACE_MISMATCH and "group 3" in refusal.detail
    assert hashes(core) == []
    assert core.state.observed[ENGINE].next_seq == 2  # the batches arrived: only their sequence numbers count


def test_a_placeholder_without_tokens_passes_the_block_size_check(core: CoordinatorCore) -> None:
    placeholder = ObservedKvEvent(kind="stored", type_name="BlockStored", medium="CPU", block_hashes=[A], block_size=0)
    assert refusals(batch(core, 0, placeholder)) == []


def test_events_of_an_engine_never_observed_are_refused() -> None:
    core = CoordinatorCore()
    for command in (
        ObserveKvEvents(engine_id="nobody", seq=0, ts=0.0, dp_rank=None, events=[stored(A)]),
        ObserveGap(engine_id="nobody", first_seq=0, last_seq=3),
        ObserveMalformed(engine_id="nobody", seq=0, detail="x"),
    ):
        [refusal] = core.execute(command)
        assert isinstance(refusal, Refused) and refusal.reason == Reason.UNKNOWN_ENGINE and "nobody" in refusal.detail
    assert core.state == State(last_event=3)


def test_a_malformed_frame_is_refused_and_its_batch_counts_as_missed_at_the_next(core: CoordinatorCore) -> None:
    batch(core, 0, stored(A))
    before = encode_state(core.state)
    [refusal] = core.execute(ObserveMalformed(engine_id=ENGINE, seq=1, detail="truncated payload"))
    assert isinstance(refusal, Refused) and refusal.reason == Reason.MALFORMED_EVENT
    assert refusal.command == "observe_malformed" and "batch 1" in refusal.detail and "truncated" in refusal.detail
    assert unchanged(core, before)
    events = batch(core, 2, stored(B, parent=A))
    assert isinstance(events[0], ObservedEventsMissed) and (events[0].first_seq, events[0].last_seq) == (1, 1)
    assert hashes(core) == [A, B]


def test_a_gap_replay_could_not_fill_is_recorded_from_the_first_batch_not_recorded(core: CoordinatorCore) -> None:
    batch(core, 0, stored(A))
    [missed] = core.execute(ObserveGap(engine_id=ENGINE, first_seq=3, last_seq=7, reason="replay buffer"))
    assert isinstance(missed, ObservedEventsMissed) and (missed.first_seq, missed.last_seq, missed.reason) == (
        1,
        7,
        "replay buffer",
    )
    observed = core.state.observed[ENGINE]
    assert (observed.next_seq, observed.complete) == (8, False)
    [refusal] = core.execute(ObserveGap(engine_id=ENGINE, first_seq=2, last_seq=7))
    assert isinstance(refusal, Refused) and refusal.reason == Reason.DUPLICATE_BATCH


def test_a_restart_is_a_new_incarnation_with_nothing_stored_and_checks_on_again(core: CoordinatorCore) -> None:
    batch(core, 0, stored(A))
    batch(core, 4, stored(B))  # incomplete from here
    events = observe(core, reason="restart: sequence went back from 4 to 0")
    assert [type(e) for e in events] == [EngineObserved]  # the namespace is known
    assert isinstance(events[0], EngineObserved) and events[0].incarnation == 2 and "4 to 0" in events[0].reason
    observed = core.state.observed[ENGINE]
    assert (observed.incarnation, observed.next_seq, observed.complete, observed.stored) == (2, 0, True, {})
    events = batch(core, 0, stored(C, parent=A))
    [refusal] = refusals(events)
    assert refusal.reason == Reason.BROKEN_PARENT_CHAIN  # A belonged to incarnation 1


def test_bad_engine_declarations_are_refused(core: CoordinatorCore) -> None:
    [refusal] = core.execute(ObserveEngine(engine_id="", namespace=b.namespace(tp=1), source="s", reason="r"))
    assert isinstance(refusal, Refused) and refusal.reason == Reason.INVALID_ARGUMENT
    [refusal] = core.execute(
        ObserveEngine(engine_id="x", namespace=b.namespace(tp=1, weights_revision=""), source="s", reason="r")
    )
    assert isinstance(refusal, Refused) and "weights_revision" in refusal.detail


def test_I18_the_same_log_projects_to_the_same_state_digest_and_survives_a_snapshot(core: CoordinatorCore) -> None:
    batch(core, 0, stored(A, B), stored(C, parent=B), stored(D, medium="CPU", group=0))
    batch(core, 1, removed(B), ObservedKvEvent(kind="unknown", type_name="X"), stored(B, parent=A))
    batch(core, 3, removed(A, C))
    observe(core, reason="restart")
    batch(core, 0, stored(D), ObservedKvEvent(kind="cleared", medium="CPU"))
    replayed = [project(core.events), project(core.events)]
    assert state_digest(replayed[0]) == state_digest(replayed[1]) == state_digest(core.state)
    assert encode_state(replayed[0]) == encode_state(core.state)
    middle = len(core.events) // 2
    resumed = project(core.events[middle:], decode_state(encode_state(project(core.events[:middle]))))
    assert encode_state(resumed) == encode_state(core.state)


def test_the_stored_hashes_keep_the_order_they_were_stored_in(core: CoordinatorCore) -> None:
    batch(core, 0, stored(D), stored(A), stored(C), stored(B))
    batch(core, 1, stored(A), removed(C))
    assert hashes(core) == [D, A, B]  # storing A again keeps its place


def test_a_snapshot_without_observed_engines_still_decodes() -> None:
    """A v2 snapshot (before State.observed existed) decodes with an empty `observed`."""

    class OldState(msgspec.Struct, kw_only=True):
        next_owner_id: int = 1
        next_job_id: int = 1
        last_event: int = 0

    old = msgspec.msgpack.encode(OldState(next_owner_id=7, last_event=12))
    state = decode_state(old)
    assert state.observed == {} and state.next_owner_id == 7 and state.last_event == 12


def test_a_data_parallel_rank_the_audit_index_cannot_hold_is_refused(core: CoordinatorCore) -> None:
    """kvl_audit_observed.dp_rank is 32-bit: a frame naming rank 2**31 stopped every catch-up of
    the audit index on PostgreSQL (found in review). Refused, the state unchanged."""
    from coordinator.core.observe import MAX_DP_RANK

    before = b.quiet_bytes(core.state)
    events = core.execute(ObserveKvEvents(engine_id=ENGINE, seq=0, ts=1.0, dp_rank=MAX_DP_RANK + 1, events=[stored(b"\x01" * 8)]))
    [refused] = refusals(events)
    assert refused.reason == Reason.INVALID_ARGUMENT and str(MAX_DP_RANK) in refused.detail
    assert b.quiet_bytes(core.state) == before
    assert not refusals(
        core.execute(ObserveKvEvents(engine_id=ENGINE, seq=0, ts=1.0, dp_rank=MAX_DP_RANK, events=[stored(b"\x01" * 8)]))
    )


@pytest.mark.parametrize("seq", [MAX_SOURCE_SEQ + 1, 2**64 - 1])
def test_a_batch_sequence_number_past_64_bits_is_refused_and_the_state_stays_encodable(core: CoordinatorCore, seq: int) -> None:
    """2**64-1 left the next expected batch unencodable: every snapshot, and the group it rode
    on, failed, and the audit index stopped (an adversarial review, session 31)."""
    before = encode_state(core.state)
    [refusal] = batch(core, seq, stored(A))
    assert isinstance(refusal, Refused) and refusal.reason == Reason.INVALID_ARGUMENT
    assert str(seq) in refusal.detail and str(MAX_SOURCE_SEQ) in refusal.detail
    assert unchanged(core, before)
    [refusal] = core.execute(ObserveGap(engine_id=ENGINE, first_seq=0, last_seq=seq, reason="lost"))
    assert isinstance(refusal, Refused) and refusal.reason == Reason.INVALID_ARGUMENT
    assert unchanged(core, before)
    events = batch(core, MAX_SOURCE_SEQ, stored(A))  # the largest taken: the next one still encodes
    assert not refusals(events)
    assert decode_state(encode_state(core.state)).observed[ENGINE].next_seq == MAX_SOURCE_SEQ + 1
