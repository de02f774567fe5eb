"""Audit queries over the index (coordinator/audit/store.py builds it). Each is a handful of
index range scans, so a point query stays fast on a large log (ops/bench/audit.py).

Every answer names the tenant whose data it holds. A query made for one tenant (`tenant=`) never
returns another's: a slot, request or key of another tenant raises `OutOfScope`; lists are
filtered (I9, for audit reads).
"""

from __future__ import annotations

import bisect
import datetime as dt
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import msgspec
import sqlalchemy as sa

from coordinator.audit import _packed as packed
from coordinator.audit.answers import (
    AuditError,
    BlockAnswer,
    DecisionEntry,
    GenerationLife,
    HistoryAnswer,
    JobTouch,
    KeyAnswer,
    KeyLoad,
    NamespaceEntry,
    NotFound,
    ObservedEvent,
    ObservedHashAnswer,
    ObservedResidency,
    OutOfScope,
    OwnerLife,
    Point,
    Publication,
    RefusalEntry,
    RequestAnswer,
    SlotEvent,
)
from coordinator.audit.index import KeyBlock
from coordinator.audit.store import indexed_seq
from events.log import SqlEventLog
from events.log import schema as t

T = TypeVar("T")
_DECLARATIONS = ("declared", "observed")
"""The kvl_audit_engines rows that put an engine under a namespace (and so a tenant): a sidecar
engine's declaration, or the start of an observed engine's incarnation (`kvledger ingest`)."""
_HOLDS = ("allocated", "reused", "freed")
"""The slot rows that change who holds a generation."""
LIST_LIMIT = 100
"""Longest list in one answer (a hot key's loads, a reused req_id's owners): a point query stays a
point query on a log of millions of events (ops/bench/audit.py)."""


# --- the reader ---------------------------------------------------------------------------------


class Audit:
    """Read-only queries; `tenant` limits every answer to that tenant's namespaces."""

    def __init__(self, event_log: SqlEventLog, tenant: str | None = None) -> None:
        self.log = event_log
        self.tenant = tenant

    async def indexed(self) -> int:
        return await indexed_seq(self.log)

    async def _read(self, query: Callable[[sa.Connection], T]) -> T:
        """Run a query's statements on one connection in one go: on SQLite in a worker thread
        through plain sqlite3 (one thread hop for the whole query, not one per statement); on
        PostgreSQL through the async engine."""
        blocking = self.log.blocking_engine
        if blocking is not None:

            def run() -> T:
                with blocking.connect() as conn:
                    return query(conn)

            return await anyio.to_thread.run_sync(run)
        async with self.log.engine.connect() as conn:
            return await conn.run_sync(query)

    # --- tenancy --------------------------------------------------------------------------
    # An engine's data belongs to the tenant of the declaration in force when it was recorded: a
    # restarted engine may be declared again under another namespace, even another tenant's.

    def _declarations(self, conn: sa.Connection) -> dict[str, tuple[list[int], list[str]]]:
        """engine -> (sequences of its declarations, the tenant each declared), in log order."""
        e, n = t.audit_engines.c, t.audit_namespaces.c
        found: dict[str, tuple[list[int], list[str]]] = {}
        for engine, seq, tenant in conn.execute(
            sa.select(e.engine, e.seq, n.tenant)
            .select_from(t.audit_engines.outerjoin(t.audit_namespaces, e.namespace_id == n.namespace_id))
            .where(e.kind.in_(_DECLARATIONS))
            .order_by(e.seq)
        ):
            seqs, tenants = found.setdefault(engine, ([], []))
            seqs.append(int(seq))
            tenants.append(str(tenant or ""))
        return found

    @staticmethod
    def _tenant_at(declarations: dict[str, tuple[list[int], list[str]]], engine: str, seq: int) -> str | None:
        """The tenant of `engine`'s declaration in force at `seq` (None before its first)."""
        seqs, tenants = declarations.get(engine, ([], []))
        index = bisect.bisect_right(seqs, seq) - 1
        return tenants[index] if index >= 0 else None

    def _visible_at(self, declarations: dict[str, tuple[list[int], list[str]]], engine: str, seq: int) -> bool:
        return self.tenant is None or self._tenant_at(declarations, engine, seq) == self.tenant

    def _spans(self, declarations: dict[str, tuple[list[int], list[str]]]) -> list[tuple[str, int, int | None]]:
        """(engine, from_seq, to_seq or None) of the caller's tenant's declarations, each run of
        declarations one after another under it merged into one span (an engine restarted 1,100
        times was 1,100 spans, and their query too deep for SQLite: the tenant's audit answered
        500; an adversarial review, session 31)."""
        spans: list[tuple[str, int, int | None]] = []
        for engine, (seqs, tenants) in declarations.items():
            for index, (seq, tenant) in enumerate(zip(seqs, tenants, strict=True)):
                if self.tenant is None or tenant == self.tenant:
                    end = seqs[index + 1] if index + 1 < len(seqs) else None
                    if spans and spans[-1][0] == engine and spans[-1][2] == seq:
                        spans[-1] = (engine, spans[-1][1], end)
                    else:
                        spans.append((engine, seq, end))
        return spans

    def _span_filter(
        self,
        conn: sa.Connection,
        engine: sa.ColumnElement[Any],
        seq: sa.ColumnElement[Any],
        declarations: dict[str, tuple[list[int], list[str]]] | None = None,
    ) -> sa.ColumnElement[bool] | None:
        """A WHERE clause keeping the rows recorded under the caller's tenant (None: keep all)."""
        if self.tenant is None:
            return None
        spans = self._spans(self._declarations(conn) if declarations is None else declarations)
        if not spans:
            return sa.false()
        ranges: dict[str, list[tuple[int, int | None]]] = {}
        for name, start, end in spans:
            ranges.setdefault(name, []).append((start, end))
        # Split on names in code-point order, as Python sorts them: PostgreSQL's text compares in
        # the database's locale unless told "C" (byte order, which is code-point order in UTF-8).
        ordered = engine.collate("C") if conn.dialect.name == "postgresql" else engine
        return _in_spans(engine, ordered, seq, sorted(ranges.items()))

    def _check(self, tenant: str | None, what: str) -> None:
        if self.tenant is not None and tenant != self.tenant:
            raise OutOfScope(f"{what} is outside tenant {self.tenant!r}")

    # --- points in time -------------------------------------------------------------------

    async def engines(self) -> list[str]:
        """The engines in the log the caller may see (declared at least once under its tenant)."""
        return await self._read(lambda conn: self._engines(conn, scoped=True))

    def _engines(self, conn: sa.Connection, *, scoped: bool) -> list[str]:
        declarations = self._declarations(conn)
        if not scoped or self.tenant is None:
            return sorted(declarations)
        return sorted({engine for engine, _, _ in self._spans(declarations)})

    async def engine(self, engine: str | None) -> str:
        """The engine asked for, or the caller's only engine. Messages list only the engines the
        caller may see; another tenant's engine is OutOfScope."""
        known = await self.engines()
        if engine is not None:
            if engine not in known:
                if self.tenant is not None and engine in await self._read(lambda conn: self._engines(conn, scoped=False)):
                    raise OutOfScope(f"engine {engine!r} is outside tenant {self.tenant!r}")
                raise NotFound(f"engine {engine!r} is not in the log (engines: {', '.join(known) or 'none'})")
            return engine
        if len(known) != 1:
            raise AuditError(f"the log has {len(known)} engines ({', '.join(known) or 'none'}): name one with --engine")
        return known[0]

    async def check_engine(self, engine: str) -> None:
        """OutOfScope unless `engine` was declared under the caller's tenant at some point."""
        if self.tenant is not None and engine not in await self.engines():
            raise OutOfScope(f"engine {engine!r} is outside tenant {self.tenant!r}")

    async def resolve(
        self, engine: str, *, at_seq: int | None = None, at_step: int | None = None, at_time: float | None = None
    ) -> int:
        """The global sequence meant by one of --at-seq, --at-step (that engine's step: its
        last event) or --at-time (the last append recorded by then); default the index's head."""
        if sum(x is not None for x in (at_seq, at_step, at_time)) > 1:
            raise AuditError("give at most one of --at-seq, --at-step and --at-time")
        await self.check_engine(engine)  # scope before existence: a missing step says nothing
        head = await self.indexed()
        if at_seq is not None:
            if at_seq < 0:
                raise AuditError(f"--at-seq must be >= 0, got {at_seq}")
            return min(at_seq, head)
        if at_step is None and at_time is None:
            return head
        if at_time is not None and not math.isfinite(at_time):
            raise AuditError(f"--at-time must be a finite time, got {at_time}")
        return await self._read(lambda conn: self._resolve(conn, engine, at_step, at_time))

    def _resolve(self, conn: sa.Connection, engine: str, at_step: int | None, at_time: float | None) -> int:
        s = t.audit_steps.c
        if at_step is not None:
            found = conn.execute(
                sa.select(s.last_seq).where(s.engine == engine, s.step == at_step).order_by(s.first_seq.desc()).limit(1)
            ).scalar()
            if found is None:
                raise NotFound(f"engine {engine!r} has no step {at_step} in the log")
            return int(found)
        assert at_time is not None
        found = conn.execute(sa.select(sa.func.max(s.last_seq)).where(s.recorded_at <= at_time)).scalar()
        if found is None:
            raise NotFound(f"nothing was recorded at or before {_when(at_time)}")
        return int(found)

    def _point(self, conn: sa.Connection, engine: str, seq: int) -> Point:
        """The engine's step at `seq` (its last step begun by then) and the time `seq` was recorded."""
        s = t.audit_steps.c
        step = conn.execute(
            sa.select(s.step).where(s.engine == engine, s.first_seq <= seq, s.step >= 0).order_by(s.first_seq.desc()).limit(1)
        ).scalar()
        return Point(seq, -1 if step is None else int(step), self._time_of(conn, seq) or 0.0)

    # --- slots ----------------------------------------------------------------------------

    async def block(self, engine: str, pool: int, block: int, at_seq: int) -> BlockAnswer:
        return await self._read(lambda conn: self._block(conn, engine, pool, block, at_seq))

    def _block(self, conn: sa.Connection, engine: str, pool: int, block: int, at_seq: int) -> BlockAnswer:
        declarations = self._declarations(conn)
        allocation = packed.last_allocation(conn, engine, pool, block, at_seq)
        tenant = self._tenant_at(declarations, engine, at_seq if allocation is None else allocation.seq)
        self._check(tenant, f"engine {engine!r} then")
        point = self._point(conn, engine, at_seq)
        if allocation is None:
            return BlockAnswer(
                engine=engine,
                pool=pool,
                block=block,
                tenant=tenant or "",
                at=point,
                status="never_allocated",
                generation=None,
                owner=None,
                jobs=[],
                events=[],
            )
        generation = allocation.generation
        # A generation's touches lie between its allocation and the next one (a slot is freed
        # before it is allocated again).
        following = packed.next_allocation(conn, engine, pool, block, allocation)
        events = [
            SlotEvent(seq, kind, owner_id, job_id, None if key is None else key.hex())
            for seq, kind, touched, owner_id, job_id, key in packed.touches_from(conn, engine, pool, block, allocation, following)
            if touched == generation
        ]
        life = self._lifetimes(conn, engine, [(generation, e.seq, e.kind, e.owner_id) for e in events], following)[0]
        # Then: the last change of hands at or before the point. A slot freed with its content kept
        # can be taken again (a reuse) without a new allocation: it is held again, by the reuser.
        changes = [e for e in events if e.kind in _HOLDS and e.seq <= at_seq]
        ended = life.ended_by in ("reset", "reallocated") and life.freed_seq is not None and life.freed_seq <= at_seq
        held = bool(changes) and changes[-1].kind != "freed" and not ended
        holder = next((e.owner_id for e in reversed(changes) if e.kind != "freed"), None)
        owner = None if holder is None else self._owner(conn, engine, holder)
        jobs = self._jobs(conn, [e for e in events if e.job_id is not None], at_seq)
        return BlockAnswer(
            engine=engine,
            pool=pool,
            block=block,
            tenant=tenant or "",
            at=point,
            status="held" if held else "free",
            generation=life,
            owner=owner,
            jobs=jobs,
            events=events,
        )

    async def history(self, engine: str, pool: int, block: int) -> HistoryAnswer:
        return await self._read(lambda conn: self._history(conn, engine, pool, block))

    def _history(self, conn: sa.Connection, engine: str, pool: int, block: int) -> HistoryAnswer:
        newest = packed.newest_allocations(conn, engine, pool, block, LIST_LIMIT)
        total = len(newest) if len(newest) < LIST_LIMIT else packed.allocation_count(conn, engine, pool, block)
        rows = (
            []
            if not newest
            else [
                (generation, seq, kind, owner_id)
                for seq, kind, generation, owner_id, _, _ in packed.touches_from(conn, engine, pool, block, newest[0])
                if kind in _HOLDS
            ]
        )
        declarations = self._declarations(conn)
        lives = [
            life
            for life in self._lifetimes(conn, engine, rows, None)
            if self._visible_at(declarations, engine, life.allocated_seq)
        ]
        if self.tenant is not None and not lives and (newest or engine not in self._engines(conn, scoped=True)):
            raise OutOfScope(f"engine {engine!r} is outside tenant {self.tenant!r}")
        tenant = (
            self.tenant
            if self.tenant is not None
            else (self._tenant_at(declarations, engine, lives[-1].allocated_seq) if lives else None)
        )
        return HistoryAnswer(
            engine=engine, pool=pool, block=block, tenant=tenant or "", generations=lives, generations_total=total
        )

    def _lifetimes(
        self, conn: sa.Connection, engine: str, rows: Sequence[tuple[Any, ...]], next_allocation: int | None
    ) -> list[GenerationLife]:
        """Lifetimes of the generations allocated in `rows` ((generation, seq, kind, owner_id) of
        one slot's allocated, reused and freed rows, in log order; other kinds are ignored). A
        generation ends at its last free that no reuse follows; when its freed notice was dropped
        (the slot was allocated again in the same step, I14), at the next allocation; or at the
        engine's reset."""
        allocations = [(int(g), int(seq), owner) for g, seq, kind, owner in rows if kind == "allocated"]
        if not allocations:
            return []
        last: dict[int, tuple[str, int]] = {}
        for generation, seq, kind, _ in rows:
            if kind in _HOLDS:
                last[int(generation)] = (str(kind), int(seq))
        e, o = t.audit_engines.c, t.audit_owners.c
        resets = [
            int(seq)
            for seq in conn.execute(
                sa.select(e.seq).where(e.engine == engine, e.kind == "reset", e.seq > allocations[0][1]).order_by(e.seq)
            ).scalars()
        ]
        owners = {owner for _, _, owner in allocations if owner is not None}
        req_ids = {
            owner_id: req_id
            for owner_id, req_id in conn.execute(
                sa.select(o.owner_id, o.req_id).where(o.engine == engine, o.kind == "started", o.owner_id.in_(owners))
            )
        }
        lives = []
        for index, (generation, seq, owner) in enumerate(allocations):
            after = allocations[index + 1][1] if index + 1 < len(allocations) else next_allocation
            kind, at = last.get(generation, ("allocated", seq))
            end: int | None = at if kind == "freed" else None
            ended_by = "freed"
            if end is None:
                later = bisect.bisect_right(resets, seq)
                reset = resets[later] if later < len(resets) else None
                end, ended_by = min(
                    ((x, why) for x, why in ((reset, "reset"), (after, "reallocated")) if x is not None), default=(None, "open")
                )
            lives.append(
                GenerationLife(
                    generation=generation,
                    owner_id=owner,
                    req_id=req_ids.get(owner, "") if owner is not None else "",
                    allocated_seq=seq,
                    allocated_step=self._point(conn, engine, seq).step,
                    freed_seq=end,
                    freed_step=None if end is None else self._point(conn, engine, end).step,
                    ended_by=ended_by,
                )
            )
        return lives

    def _jobs(self, conn: sa.Connection, touches: Sequence[SlotEvent], at_seq: int) -> list[JobTouch]:
        ids = sorted({e.job_id for e in touches if e.job_id is not None})
        if not ids:
            return []
        j = t.audit_jobs.c
        rows = (
            conn.execute(sa.select(j.job_id, j.seq, j.kind, j.rank, j.detail).where(j.job_id.in_(ids)).order_by(j.job_id, j.seq))
        ).all()
        by_job: dict[int, list[Any]] = {}
        for row in rows:
            by_job.setdefault(row.job_id, []).append(row)
        touched = {e.job_id: e for e in touches}
        return [job_touch(job_id, by_job.get(job_id, []), touched[job_id].seq, at_seq) for job_id in ids]

    # --- owners and requests --------------------------------------------------------------

    def _owner(self, conn: sa.Connection, engine: str, owner_id: int) -> OwnerLife | None:
        return self._owners(conn, [(engine, owner_id)], blocks=False).get((engine, owner_id))

    def _owners(
        self, conn: sa.Connection, wanted: Sequence[tuple[str, int]], *, blocks: bool
    ) -> dict[tuple[str, int], OwnerLife]:
        """Each owner's lifetime (and with `blocks`, every allocation and reuse it made), in one
        query per table per engine."""
        o = t.audit_owners.c
        by_engine: dict[str, list[int]] = {}
        for engine, owner_id in wanted:
            by_engine.setdefault(engine, []).append(owner_id)
        lives: dict[tuple[str, int], OwnerLife] = {}
        for engine, ids in by_engine.items():
            rows: dict[int, list[Any]] = {}
            for row in conn.execute(
                sa.select(o.owner_id, o.req_id, o.seq, o.kind, o.detail)
                .where(o.engine == engine, o.owner_id.in_(ids))
                .order_by(o.seq)
            ):
                rows.setdefault(row.owner_id, []).append(row)
            held: dict[int, list[str]] = {}
            if blocks:
                for owner_id, entries in packed.owner_blocks(conn, engine, ids).items():
                    held[owner_id] = [
                        f"{pool}/{block}@g{generation} ({kind} at seq {seq})" for seq, kind, pool, block, generation in entries
                    ]
            for owner_id, found in rows.items():
                started = next((r for r in found if r.kind == "started"), None)
                if started is None:
                    continue
                finished = next((r for r in found if r.kind == "finished"), None)
                lives[(engine, owner_id)] = OwnerLife(
                    engine=engine,
                    owner_id=owner_id,
                    req_id=started.req_id,
                    started_seq=started.seq,
                    finished_seq=None if finished is None else finished.seq,
                    finished_reason="" if finished is None else finished.detail,
                    resumed=started.detail == "resumed",
                    blocks=held.get(owner_id, []),
                )
        return lives

    async def request(self, req_id: str) -> RequestAnswer:
        return await self._read(lambda conn: self._request(conn, req_id))

    def _request(self, conn: sa.Connection, req_id: str) -> RequestAnswer:
        o = t.audit_owners.c
        query = sa.select(o.engine, o.owner_id).where(o.req_id == req_id, o.kind == "started")
        mine = self._span_filter(conn, o.engine, o.seq)
        if mine is not None:
            if conn.execute(query.where(mine).limit(1)).first() is None and conn.execute(query.limit(1)).first() is not None:
                raise OutOfScope(f"request {req_id!r} is outside tenant {self.tenant!r}")
            query = query.where(mine)
        rows = conn.execute(query.order_by(o.seq.desc()).limit(LIST_LIMIT)).all()[::-1]
        if not rows:
            raise NotFound(f"request {req_id!r} is not in the log")
        total = (
            len(rows)
            if len(rows) < LIST_LIMIT
            else int(conn.execute(sa.select(sa.func.count()).select_from(query.subquery())).scalar() or 0)
        )
        lives = self._owners(conn, [(r.engine, r.owner_id) for r in rows], blocks=True)
        owners = [lives[(r.engine, r.owner_id)] for r in rows if (r.engine, r.owner_id) in lives]
        return RequestAnswer(req_id=req_id, owners=owners, owners_total=total)

    # --- keys -----------------------------------------------------------------------------

    async def key(self, key_hex: str) -> KeyAnswer:
        return await self._read(lambda conn: self._key(conn, key_hex))

    def _key(self, conn: sa.Connection, key_hex: str) -> KeyAnswer:
        try:
            key = bytes.fromhex(key_hex)
        except ValueError as error:
            raise AuditError(f"key {key_hex!r} is not hex: {error}") from error
        k, n = t.audit_keys.c, t.audit_namespaces.c
        counts = {
            str(kind): int(count)
            for kind, count in conn.execute(sa.select(k.kind, sa.func.count()).where(k.key == key).group_by(k.kind))
        }
        counts = dict(sorted({**counts, **packed.key_block_counts(conn, key)}.items()))
        if not counts:
            raise NotFound(f"key {key_hex} is not in the log")

        def newest(kind: str) -> list[Any]:  # one range of the (key, kind, seq) index
            return list(
                conn.execute(
                    sa.select(t.audit_keys).where(k.key == key, k.kind == kind).order_by(k.seq.desc()).limit(LIST_LIMIT)
                ).all()
            )[::-1]

        computed = packed.newest_key_blocks(conn, key, "computed", LIST_LIMIT) if "computed" in counts else []
        loads = packed.newest_key_blocks(conn, key, "loaded", LIST_LIMIT) if "loaded" in counts else []
        published = newest("published")
        rows = [*computed, *published, *newest("evicted"), *newest("quarantined")]
        stored = packed.stores_by(conn, key, {r.job_id for r in published if r.job_id is not None})
        rows += stored
        namespace = next((bytes(r.namespace_id) for r in [*rows, *loads] if r.namespace_id is not None), b"")
        spec = conn.execute(sa.select(n.tenant, n.model_id).where(n.namespace_id == namespace)).first()
        tenant, model = (spec.tenant, spec.model_id) if spec is not None else ("", "")
        self._check(tenant, f"key {key_hex}")
        j = t.audit_jobs.c
        job_ids = {r.job_id for r in [*rows, *loads] if r.job_id is not None}
        outcomes: dict[int, list[Any]] = {}
        for row in conn.execute(
            sa.select(j.job_id, j.seq, j.kind, j.rank, j.detail).where(j.job_id.in_(job_ids)).order_by(j.seq)
        ):
            outcomes.setdefault(row.job_id, []).append(row)
        stored_from = {r.job_id: _where(r) for r in stored}

        def load(r: KeyBlock) -> KeyLoad:
            assert r.job_id is not None  # every load is a job's
            return KeyLoad(
                r.seq,
                r.engine,
                r.job_id,
                _where(r, engine=False),
                job_touch(r.job_id, outcomes.get(r.job_id, []), r.seq, r.seq).outcome,
            )

        return KeyAnswer(
            key=key_hex,
            namespace_id=namespace.hex(),
            tenant=tenant,
            model_id=model,
            computed=[f"{r.engine} {r.pool}/{r.block}@g{r.generation} at seq {r.seq}" for r in computed],
            publications=[
                Publication(
                    r.seq,
                    r.tier,
                    r.tier_slot,
                    r.size_bytes,
                    r.job_id,
                    stored_from.get(r.job_id, "?"),
                    r.checksums.split(",") if r.checksums else [],
                )
                for r in published
            ],
            loads=[load(r) for r in loads],
            evictions=[r.seq for r in rows if r.kind == "evicted"],
            quarantines=[f"seq {r.seq}: {r.detail}" for r in rows if r.kind == "quarantined"],
            counts=counts,
        )

    # --- observed engines' block hashes (kvledger ingest) -----------------------------------

    async def observed(self, hash_hex: str) -> ObservedHashAnswer:
        """When an observed engine (vLLM) stored and removed a block hash: by which incarnation,
        in which medium and group, at which global sequence and at which of the engine's own."""
        return await self._read(lambda conn: self._observed(conn, hash_hex))

    def _observed(self, conn: sa.Connection, hash_hex: str) -> ObservedHashAnswer:
        text = hash_hex.strip().lower().removeprefix("0x")
        try:
            block_hash = bytes.fromhex(text)
        except ValueError as error:
            raise AuditError(f"block hash {hash_hex[:80]!r} is not hex: {error}") from error
        if not block_hash:
            raise AuditError("the block hash is empty")
        o, e = t.audit_observed.c, t.audit_engines.c
        # The caller's rows only, in SQL: another tenant's newer rows must not crowd them out of the list.
        declarations = self._declarations(conn)
        scope = self._span_filter(conn, o.engine, o.seq, declarations)
        mine = (o.hash == block_hash, *(() if scope is None else (scope,)))
        visible = conn.execute(sa.select(t.audit_observed).where(*mine).order_by(o.seq.desc()).limit(LIST_LIMIT)).all()[::-1]
        if not visible:
            if conn.execute(sa.select(o.seq).where(o.hash == block_hash).limit(1)).first() is None:
                raise NotFound(f"block hash {text} is not in the log")
            raise OutOfScope(f"block hash {text} is outside tenant {self.tenant!r}")
        total = (
            len(visible)
            if len(visible) < LIST_LIMIT
            else int(conn.execute(sa.select(sa.func.count()).where(*mine)).scalar() or 0)
        )
        engines = sorted({r.engine for r in visible})
        since = int(visible[0].seq)
        # The same engine may have been observed again under another tenant: its clears and gaps
        # then are that tenant's. A restart is also the caller's when it ends the caller's incarnation.
        clears = [
            r
            for r in conn.execute(
                sa.select(t.audit_observed).where(o.hash == b"", o.seq > since, o.engine.in_(engines)).order_by(o.seq)
            ).all()
            if self._visible_at(declarations, r.engine, int(r.seq))
        ]
        lives = [
            r
            for r in conn.execute(
                sa.select(e.engine, e.incarnation, e.seq, e.kind, e.detail)
                .where(e.engine.in_(engines), e.kind.in_(("observed", "events_missed")), e.seq > since)
                .order_by(e.seq)
            ).all()
            if self._visible_at(declarations, r.engine, int(r.seq))
            or (r.kind == "observed" and self._visible_at(declarations, r.engine, int(r.seq) - 1))
        ]
        timeline = sorted(
            [
                ObservedEvent(
                    int(r.seq), r.kind, r.engine, int(r.incarnation), r.medium, int(r.grp), r.dp_rank, int(r.source_seq)
                )
                for r in visible
            ]
            + [
                ObservedEvent(int(r.seq), "cleared", r.engine, int(r.incarnation), r.medium, None, r.dp_rank, int(r.source_seq))
                for r in clears
            ]
            + [
                ObservedEvent(int(r.seq), "restarted", r.engine, int(r.incarnation), "", None, None, None)
                for r in lives
                if r.kind == "observed"
            ],
            key=lambda event: event.seq,
        )
        residencies = _residencies(timeline)
        involved = {(r.engine, r.incarnation) for r in residencies}
        gaps = [
            f"{r.engine} incarnation {r.incarnation} at seq {r.seq}: {r.detail}"
            for r in lives
            if r.kind == "events_missed" and (r.engine, int(r.incarnation)) in involved
        ]
        enders = {r.ended_seq for r in residencies if r.ended_by in ("cleared", "restarted")}
        events = [ev for ev in timeline if ev.kind in ("stored", "removed") or ev.seq in enders]
        tenant = self._tenant_at(declarations, visible[-1].engine, int(visible[-1].seq)) or ""
        return ObservedHashAnswer(hash=text, tenant=tenant, residencies=residencies, events=events, total=total, gaps=gaps)

    # --- refusals and namespaces ----------------------------------------------------------

    async def refusals(self, *, since_seq: int = 0, since_time: float | None = None, limit: int = 1000) -> list[RefusalEntry]:
        return await self._read(lambda conn: self._refusals(conn, since_seq=since_seq, since_time=since_time, limit=limit))

    def _refusals(
        self, conn: sa.Connection, *, since_seq: int = 0, since_time: float | None = None, limit: int = 1000
    ) -> list[RefusalEntry]:
        r = t.audit_refusals.c
        if since_time is not None:
            found = (
                conn.execute(sa.select(sa.func.max(t.audit_steps.c.last_seq)).where(t.audit_steps.c.recorded_at < since_time))
            ).scalar()
            since_seq = max(since_seq, int(found or 0))
        st = t.audit_steps.c
        step = (
            sa.select(st.step)
            .where(st.engine == r.engine, st.first_seq <= r.seq, st.step >= 0)
            .order_by(st.first_seq.desc())
            .limit(1)
            .scalar_subquery()
        )  # the engine's step then
        recorded = (
            sa.select(st.recorded_at).where(st.first_seq <= r.seq).order_by(st.first_seq.desc()).limit(1).scalar_subquery()
        )  # when its append was recorded
        query = (
            sa.select(t.audit_refusals, step.label("step"), recorded.label("recorded_at"))
            .where(r.seq > since_seq)
            .order_by(r.seq)
            .limit(limit)
        )
        mine = self._span_filter(conn, r.engine, r.seq)
        if mine is not None:
            query = query.where(mine)
        return [
            RefusalEntry(
                row.seq,
                -1 if row.step is None else int(row.step),
                float(row.recorded_at or 0.0),
                row.engine,
                row.kind,
                row.subject,
                row.reason,
                row.detail,
            )
            for row in conn.execute(query)
        ]

    async def namespaces(self, *, now: float) -> list[NamespaceEntry]:
        """Inventory for cleanup decisions: live keys (published, not evicted since), their bytes,
        the first publication and the last use (a publication or a load)."""
        return await self._read(lambda conn: self._namespaces(conn, now=now))

    def _namespaces(self, conn: sa.Connection, *, now: float) -> list[NamespaceEntry]:
        n = t.audit_namespaces.c
        query = sa.select(t.audit_namespaces).order_by(n.seq)
        if self.tenant is not None:
            query = query.where(n.tenant == self.tenant)
        entries = []
        for space in (conn.execute(query)).all():
            live = (conn.execute(_LIVE_KEYS, {"namespace": space.namespace_id})).first()
            first, published_last = (conn.execute(_PUBLISHED, {"namespace": space.namespace_id})).first() or (None, None)
            used = [seq for seq in (published_last, packed.last_load(conn, bytes(space.namespace_id))) if seq is not None]
            last = max(used) if used else None  # a publication or a load
            first_at = None if first is None else self._time_of(conn, int(first))
            last_at = None if last is None else self._time_of(conn, int(last))
            entries.append(
                NamespaceEntry(
                    namespace_id=bytes(space.namespace_id).hex(),
                    tenant=space.tenant,
                    model_id=space.model_id,
                    spec=msgspec.json.decode(space.spec),
                    keys=int(live[0] or 0) if live else 0,
                    bytes=int(live[1] or 0) if live else 0,
                    first_published_at=first_at,
                    last_used_at=last_at,
                    age_seconds=None if first_at is None else max(0.0, now - first_at),
                    decisions=self._decisions(conn, bytes(space.namespace_id)),
                )
            )
        return entries

    async def decisions(self, namespace: str | None = None) -> list[DecisionEntry]:
        """Namespace release decisions and releases, oldest first; with `namespace` (hex), those
        from or to it. A decision never relates two tenants (the decider refuses it), so its
        tenant is its from-namespace's."""
        if namespace is None:
            return await self._read(lambda conn: self._decisions(conn, None))
        try:
            wanted = bytes.fromhex(namespace)
        except ValueError as error:
            raise AuditError(f"namespace {namespace!r} is not hex: {error}") from error

        def query(conn: sa.Connection) -> list[DecisionEntry]:
            n = t.audit_namespaces.c
            tenant = conn.execute(sa.select(n.tenant).where(n.namespace_id == wanted)).scalar()
            if tenant is None:
                raise NotFound(f"namespace {namespace} is not in the log")
            self._check(str(tenant), f"namespace {namespace}")
            return self._decisions(conn, wanted)

        return await self._read(query)

    def _decisions(self, conn: sa.Connection, namespace: bytes | None) -> list[DecisionEntry]:
        d, n = t.audit_decisions.c, t.audit_namespaces.c
        query = (
            sa.select(t.audit_decisions, n.tenant)
            .select_from(t.audit_decisions.outerjoin(t.audit_namespaces, d.from_namespace == n.namespace_id))
            .order_by(d.seq)
        )
        if namespace is not None:
            query = query.where(sa.or_(d.from_namespace == namespace, d.to_namespace == namespace))
        if self.tenant is not None:
            query = query.where(n.tenant == self.tenant)
        entries = []
        for row in (conn.execute(query)).all():
            entries.append(
                DecisionEntry(
                    seq=int(row.seq),
                    recorded_at=self._time_of(conn, int(row.seq)),
                    outcome=row.outcome,
                    from_namespace=bytes(row.from_namespace).hex(),
                    to_namespace=None if row.to_namespace is None else bytes(row.to_namespace).hex(),
                    tenant=str(row.tenant or ""),
                    affected_keys=int(row.affected_keys),
                    evidence=row.evidence,
                    reason=row.reason,
                )
            )
        return entries

    def _time_of(self, conn: sa.Connection, seq: int) -> float | None:
        """When the append holding `seq` was recorded (every append has a kvl_audit_steps row)."""
        s = t.audit_steps.c
        found = conn.execute(sa.select(s.recorded_at).where(s.first_seq <= seq).order_by(s.first_seq.desc()).limit(1)).scalar()
        return None if found is None else float(found)


_LIVE_KEYS = sa.text(
    # A key is live in a tier from its last publication there until an eviction from that tier, or
    # a quarantine, after it; the same key may be live in several tiers and pools.
    "SELECT count(*), sum(p.size_bytes) FROM ("
    " SELECT key, tier, pool, max(seq) AS seq, max(size_bytes) AS size_bytes FROM kvl_audit_keys"
    " WHERE namespace_id = :namespace AND kind = 'published' GROUP BY key, tier, pool) AS p"
    " WHERE NOT EXISTS (SELECT 1 FROM kvl_audit_keys AS e WHERE e.key = p.key AND e.kind IN ('evicted', 'quarantined')"
    " AND e.tier = p.tier AND e.pool = p.pool AND e.seq > p.seq)"
)
_PUBLISHED = sa.text("SELECT min(seq), max(seq) FROM kvl_audit_keys WHERE namespace_id = :namespace AND kind = 'published'")


def _residencies(timeline: Sequence[ObservedEvent]) -> list[ObservedResidency]:
    """Each stay of the hash, from its store to the removal, clear of its medium, or restart of
    its engine that ended it (a store of a hash already there does not start another)."""
    open_: dict[tuple[str, int, str, int], ObservedEvent] = {}
    done: list[ObservedResidency] = []

    def close(key: tuple[str, int, str, int], end: ObservedEvent | None, how: str) -> None:
        start = open_.pop(key)
        assert start.source_seq is not None and start.group is not None
        done.append(
            ObservedResidency(
                engine=start.engine,
                incarnation=start.incarnation,
                medium=start.medium,
                group=start.group,
                dp_rank=start.dp_rank,
                stored_seq=start.seq,
                stored_source_seq=start.source_seq,
                ended_seq=None if end is None else end.seq,
                ended_source_seq=None if end is None else end.source_seq,
                ended_by=how,
            )
        )

    for event in timeline:
        if event.kind in ("stored", "removed"):
            assert event.group is not None
            key = (event.engine, event.incarnation, event.medium, event.group)
            if event.kind == "stored":
                open_.setdefault(key, event)
            elif key in open_:
                close(key, event, "removed")
        elif event.kind == "cleared":
            for key in [k for k in open_ if k[:3] == (event.engine, event.incarnation, event.medium)]:
                close(key, event, "cleared")
        else:  # a new incarnation: the old one's cache is gone
            for key in [k for k in open_ if k[0] == event.engine and k[1] < event.incarnation]:
                close(key, event, "restarted")
    for key in list(open_):
        close(key, None, "stored")
    return sorted(done, key=lambda r: r.stored_seq)


def _where(row: Any, *, engine: bool = True) -> str:
    """A key row's device end: `engine pool/block@generation`, or for an engine that owns its
    blocks (vLLM's offloading: external keys) `engine pool <group> (engine key <hex>)`."""
    who = f"{row.engine} " if engine else ""
    if row.block is None:
        return f"{who}pool {row.pool} ({row.detail})" if row.detail else f"{who}pool {row.pool}"
    return f"{who}{row.pool}/{row.block}@g{row.generation}"


def job_touch(job_id: int, rows: Sequence[Any], touched_seq: int, at_seq: int) -> JobTouch:
    started = next((r for r in rows if r.kind in ("store", "load", "copy")), None)
    kind = started.kind if started is not None else "?"
    start = started.seq if started is not None else touched_seq
    outcome, ended = "in flight", None
    pending = 0
    for row in rows:
        if row.kind == "succeeded":
            outcome, ended = "succeeded", row.seq
        elif row.kind == "failed":
            outcome, ended = f"failed: {row.detail}", row.seq
        elif row.kind == "fenced":
            pending = row.detail.count(",") + 1 if row.detail else 0
            outcome, ended = "fenced", (row.seq if pending == 0 else None)
        elif row.kind == "fenced_rank_done":
            pending -= 1
            if pending <= 0:
                ended = row.seq
    # A store decided without its pin (the simulator's PINS protection off) never pinned: the
    # index says so in the decision's detail (coordinator/audit/index.py).
    held = started is None or not started.detail.endswith(", NOT pinned")
    pinned = held and start <= at_seq and (ended is None or at_seq < ended)
    return JobTouch(job_id, kind, start, ended, outcome, pinned)


def _when(epoch: float) -> str:
    try:
        return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat()
    except (ValueError, OverflowError, OSError):  # beyond the calendar datetime knows
        return f"{epoch:g} s since the epoch"


def parse_time(text: str) -> float:
    """Seconds since the epoch, from an ISO 8601 time (UTC when it names no zone) or a number."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError as error:
        raise AuditError(f"time {text!r} is neither ISO 8601 nor seconds since the epoch") from error
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


_FLAT = 8
"""Terms an OR of the span filter holds before it splits (`_in_spans`)."""


def _in_spans(
    engine: sa.ColumnElement[Any],
    ordered: sa.ColumnElement[Any],
    seq: sa.ColumnElement[Any],
    ranges: list[tuple[str, list[tuple[int, int | None]]]],
) -> sa.ColumnElement[bool]:
    """Rows of these engines (`ranges` sorted by name in code-point order; `ordered`, the engine
    column compared in that order) within these sequence ranges (each engine's sorted, apart), as
    a search tree: split on the middle engine's name, then on the middle range's start. SQLite
    parses a flat OR of n terms n deep and refuses one deeper than 1,000 ("Expression tree is too
    large"): an engine declared in turn under two tenants 2,100 times was 1,050 spans of one
    tenant, whose audit then answered 500 (an adversarial review, session 31). Split, n spans are
    ~2 log2(n) deep and take ~3 parameters each; the AND of each side keeps its OR in parentheses."""
    if len(ranges) > _FLAT:
        middle = len(ranges) // 2
        split = ranges[middle][0]
        return sa.or_(
            sa.and_(ordered < split, _in_spans(engine, ordered, seq, ranges[:middle])),
            sa.and_(ordered >= split, _in_spans(engine, ordered, seq, ranges[middle:])),
        )
    return sa.or_(*(sa.and_(engine == name, _in_ranges(seq, of_engine)) for name, of_engine in ranges))


def _in_ranges(seq: sa.ColumnElement[Any], ranges: list[tuple[int, int | None]]) -> sa.ColumnElement[bool]:
    if len(ranges) > _FLAT:
        middle = len(ranges) // 2
        split = ranges[middle][0]
        return sa.or_(
            sa.and_(seq < split, _in_ranges(seq, ranges[:middle])), sa.and_(seq >= split, _in_ranges(seq, ranges[middle:]))
        )
    return sa.or_(*(sa.and_(seq >= start, *(() if end is None else (seq < end,))) for start, end in ranges))
