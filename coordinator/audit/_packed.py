"""Reading the packed rows of the audit index: a slot's touches, an owner's blocks, a key's blocks
(coordinator/audit/index.py describes the rows and their entries). The queries
(queries.py, timeline.py) ask for entries; these functions find the rows that hold them.

A slot's rows never overlap in sequences and are ordered by `first_seq`, so the touches of a
range of sequences are in the rows from the one holding its start; and the last allocation at or
before N is in the last row whose first allocation is at or before N.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import sqlalchemy as sa

from coordinator.audit.index import (
    KEY_BLOCK_KINDS,
    SLOT_WINDOW_BITS,
    KeyBlock,
    OwnerBlock,
    SlotTouch,
    unpack_key_blocks,
    unpack_owner_blocks,
    unpack_touches,
)
from events.log import schema as t

_s = t.audit_slots.c


class Allocation(msgspec.Struct, frozen=True):
    """One `allocated` touch of a slot, and the row that holds it."""

    seq: int
    generation: int
    row_first_seq: int
    """first_seq of the kvl_audit_slots row holding it."""
    next_in_row: int | None
    """The sequence of the next allocation in the same row, if it holds one."""


def _allocations(first_seq: int, touches: list[SlotTouch]) -> list[Allocation]:
    """The row's allocations, in log order."""
    seqs = [touch[0] for touch in touches if touch[1] == "allocated"]
    generations = [touch[2] for touch in touches if touch[1] == "allocated"]
    return [
        Allocation(seq, generation, first_seq, seqs[index + 1] if index + 1 < len(seqs) else None)
        for index, (seq, generation) in enumerate(zip(seqs, generations, strict=True))
    ]


def _slot(engine: str, pool: int, block: int) -> tuple[sa.ColumnElement[bool], ...]:
    return (_s.engine == engine, _s.pool == pool, _s.block == block)


def last_allocation(conn: sa.Connection, engine: str, pool: int, block: int, at_seq: int) -> Allocation | None:
    """The slot's last allocation at or before `at_seq` (None: never allocated by then)."""
    row = conn.execute(
        sa.select(_s.first_seq, _s.packed)
        .where(*_slot(engine, pool, block), _s.first_allocated <= at_seq)
        .order_by(_s.first_seq.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    return [a for a in _allocations(int(row.first_seq), unpack_touches(row.packed)) if a.seq <= at_seq][-1]


def next_allocation(conn: sa.Connection, engine: str, pool: int, block: int, after: Allocation) -> int | None:
    """The sequence of the slot's first allocation after `after` (None: none yet)."""
    if after.next_in_row is not None:
        return after.next_in_row
    following = conn.execute(
        sa.select(_s.first_allocated)
        .where(*_slot(engine, pool, block), _s.first_seq > after.row_first_seq, _s.first_allocated.is_not(None))
        .order_by(_s.first_seq)
        .limit(1)
    ).scalar()
    return None if following is None else int(following)


def touches_from(
    conn: sa.Connection, engine: str, pool: int, block: int, start: Allocation, before: int | None = None
) -> Iterator[SlotTouch]:
    """The slot's touches from `start`'s on (its own included), before sequence `before` when
    given, in log order."""
    query = sa.select(_s.packed).where(*_slot(engine, pool, block), _s.first_seq >= start.row_first_seq)
    if before is not None:
        query = query.where(_s.first_seq < before)
    for packed in conn.execute(query.order_by(_s.first_seq)).scalars():
        for touch in unpack_touches(packed):
            if touch[0] >= start.seq and (before is None or touch[0] < before):
                yield touch


def newest_allocations(conn: sa.Connection, engine: str, pool: int, block: int, limit: int) -> list[Allocation]:
    """The slot's newest `limit` allocations, oldest first (every row with a first allocation
    holds at least one: `limit` rows are enough)."""
    found: list[Allocation] = []
    for first_seq, packed in conn.execute(
        sa.select(_s.first_seq, _s.packed)
        .where(*_slot(engine, pool, block), _s.first_allocated.is_not(None))
        .order_by(_s.first_seq.desc())
        .limit(limit)
    ):
        found += reversed(_allocations(int(first_seq), unpack_touches(packed)))
        if len(found) >= limit:
            break
    return found[:limit][::-1]


def allocation_count(conn: sa.Connection, engine: str, pool: int, block: int) -> int:
    return int(conn.execute(sa.select(sa.func.sum(_s.allocations)).where(*_slot(engine, pool, block))).scalar() or 0)


def owner_blocks(conn: sa.Connection, engine: str, owner_ids: list[int]) -> dict[int, list[OwnerBlock]]:
    """Each owner's allocated and reused slots, in log order."""
    o = t.audit_owner_blocks.c
    found: dict[int, list[OwnerBlock]] = {}
    for owner_id, packed in conn.execute(
        sa.select(o.owner_id, o.packed).where(o.engine == engine, o.owner_id.in_(owner_ids)).order_by(o.first_seq)
    ):
        found.setdefault(int(owner_id), []).extend(unpack_owner_blocks(packed))
    return found


def key_block_counts(conn: sa.Connection, key: bytes) -> dict[str, int]:
    """How many times `key` was computed, stored and loaded (the kinds it has)."""
    c = t.audit_key_blocks.c
    sums = conn.execute(
        sa.select(sa.func.sum(c.computed), sa.func.sum(c.stored), sa.func.sum(c.loaded)).where(c.key == key)
    ).one()
    return {kind: int(count) for kind, count in zip(KEY_BLOCK_KINDS, sums, strict=True) if count}


def newest_key_blocks(conn: sa.Connection, key: bytes, kind: str, limit: int) -> list[KeyBlock]:
    """The newest `limit` entries of one kind (computed, stored or loaded) of `key`, oldest first."""
    c = t.audit_key_blocks.c
    count = {"computed": c.computed, "stored": c.stored, "loaded": c.loaded}[kind]
    found: list[KeyBlock] = []
    for packed, namespace in conn.execute(
        sa.select(c.packed, c.namespace_id).where(c.key == key, count > 0).order_by(c.first_seq.desc()).limit(limit)
    ):
        found += reversed([entry for entry in unpack_key_blocks(packed, _bytes(namespace)) if entry.kind == kind])
        if len(found) >= limit:
            break
    return found[:limit][::-1]


def stores_by(conn: sa.Connection, key: bytes, job_ids: set[int]) -> list[KeyBlock]:
    """The stores of `key` by these jobs, in log order. Read from the newest row back, until every
    job is found: a hot key is stored again and again, and its publications' jobs are the newest
    (a job's entries are in one row: one event's)."""
    c = t.audit_key_blocks.c
    wanted = set(job_ids)
    found: list[KeyBlock] = []
    for packed, namespace in conn.execute(
        sa.select(c.packed, c.namespace_id).where(c.key == key, c.stored > 0).order_by(c.first_seq.desc())
    ):
        if not wanted:
            break
        stores = [e for e in unpack_key_blocks(packed, _bytes(namespace)) if e.kind == "stored" and e.job_id in wanted]
        found += reversed(stores)
        wanted -= {e.job_id for e in stores}
    return found[::-1]


def last_load(conn: sa.Connection, namespace: bytes) -> int | None:
    """The sequence of the last load of a key of `namespace` (ix_kvl_audit_key_blocks_loaded)."""
    c = t.audit_key_blocks.c
    found = conn.execute(
        sa.select(sa.func.max(c.last_loaded)).where(c.namespace_id == namespace, c.last_loaded.is_not(None))
    ).scalar()
    return None if found is None else int(found)


def _bytes(value: bytes | memoryview | None) -> bytes | None:
    return None if value is None else bytes(value)


# --- a pool over a range (kvledger audit timeline) ---------------------------------------------


PoolTouch = tuple[int, SlotTouch]
"""block, and one touch of it."""


def pool_touches(conn: sa.Connection, engine: str, pool: int, first_seq: int, last_seq: int) -> list[PoolTouch]:
    """Every touch of the pool's slots from `first_seq` to `last_seq`, each slot's in log order.
    A row's touches lie in one window of sequences, so its rows start at or after the window of
    `first_seq` (the (engine, pool, first_seq) index)."""
    window_start = (first_seq >> SLOT_WINDOW_BITS) << SLOT_WINDOW_BITS
    query = (
        sa.select(_s.block, _s.packed)
        .where(_s.engine == engine, _s.pool == pool, _s.first_seq >= window_start, _s.first_seq <= last_seq)
        .where(_s.last_seq >= first_seq)
        .order_by(_s.block, _s.first_seq)
    )
    return [
        (int(block), touch)
        for block, packed in conn.execute(query)
        for touch in unpack_touches(packed)
        if first_seq <= touch[0] <= last_seq
    ]


def held_before(conn: sa.Connection, engine: str, pool: int, seq: int) -> list[PoolTouch]:
    """For each slot of the pool, the touches before `seq` of the generation it held then (its
    last allocation before `seq`), from that allocation on.

    Cost: the pool's rows with an allocation before `seq`, grouped (as the row-per-touch index
    scanned the pool's allocations), then the rows from each one's last allocation."""
    of_pool = (_s.engine == engine, _s.pool == pool)
    starts = [
        (int(block), int(first_seq))
        for block, first_seq in conn.execute(
            sa.select(_s.block, sa.func.max(_s.first_seq)).where(*of_pool, _s.first_allocated < seq).group_by(_s.block)
        )
    ]
    found: list[PoolTouch] = []
    for start in range(0, len(starts), 200):  # bounded OR lists
        chunk = dict(starts[start : start + 200])
        rows: dict[int, list[tuple[int, bytes]]] = {}
        for block, first_seq, packed in conn.execute(
            sa.select(_s.block, _s.first_seq, _s.packed)
            .where(*of_pool, _s.first_seq < seq, sa.or_(*(sa.and_(_s.block == b, _s.first_seq >= q) for b, q in chunk.items())))
            .order_by(_s.block, _s.first_seq)
        ):
            rows.setdefault(int(block), []).append((int(first_seq), packed))
        for block, found_rows in rows.items():
            touches = [touch for _, packed in found_rows for touch in unpack_touches(packed) if touch[0] < seq]
            allocation = [touch for touch in touches if touch[1] == "allocated"][-1]
            found += [(block, touch) for touch in touches if touch[0] >= allocation[0] and touch[2] == allocation[2]]
    return found
