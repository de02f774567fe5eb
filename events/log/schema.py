"""The log's tables, as SQLAlchemy Core metadata. migrations/ versions create exactly these."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

# SQLite only autoincrements an INTEGER PRIMARY KEY (the rowid alias); PostgreSQL gets BIGINT.
_Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# An event id compares byte by byte (as Python compares str, by code point) on both SQL logs: a
# run's bounds and the range checks against them must agree with `<` in the append's code.
# SQLite's default collation (BINARY) already does; PostgreSQL's follows the database's locale
# unless the column says "C" (migration 0010).
_EventId = sa.String(64).with_variant(sa.String(64, collation="C"), "postgresql")

steps = sa.Table(
    "kvl_steps",
    metadata,
    # One row per stream per append (for an engine: one scheduler step). Storing a step's events
    # in one row, rather than a row each, is what makes appends and replay fast: a 256-event step
    # is one row to write and one msgspec call to decode (ops/bench/log.py).
    sa.Column("first_seq", _Seq, primary_key=True, autoincrement=False),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("stream_id", sa.String(255), nullable=False),
    # The stream version of the first event; the step's events have consecutive versions.
    sa.Column("first_version", sa.Integer, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("recorded_at", sa.Float, nullable=False),
    # Every distinct "type@schema_version" in the step, sorted and comma-joined: a reader whose
    # code is current for all of them decodes the whole payload in one call.
    sa.Column("schemas", sa.Text, nullable=False),
    # msgpack: one entry per event (event id, type, schema version, payload length, step, time).
    sa.Column("header", sa.LargeBinary, nullable=False),
    # The events' payloads, concatenated in order; the header gives each one's length.
    sa.Column("payload", sa.LargeBinary, nullable=False),
    # How header and payload are stored: 0 as they are, 1 each compressed with LZ4 (block format,
    # size-prefixed). Migration 0008; events/log/_sql.py packs and reads them.
    sa.Column("codec", sa.SmallInteger, nullable=False, server_default="0"),
    sa.UniqueConstraint("stream_id", "first_version", name="uq_kvl_steps_stream_version"),
)
# One stream's steps after a sequence, in order (EventLog.read_stream_steps: a worker's catch-up).
sa.Index("ix_kvl_steps_stream_last", steps.c.stream_id, steps.c.last_seq)

event_ids = sa.Table(
    "kvl_event_ids",
    metadata,
    # Event ids are unique across the whole log (DESIGN.md, "The log"); the primary key keeps
    # them unique, and a step's ascending ids are a kvl_id_runs row instead (below).
    sa.Column("event_id", _EventId, primary_key=True),
    sa.Column("global_seq", sa.BigInteger, nullable=False),
    sqlite_with_rowid=False,
)

id_runs = sa.Table(
    "kvl_id_runs",
    metadata,
    # A step whose event ids ascend, all above every id before it: its lowest and highest id, in
    # place of a kvl_event_ids row each. Runs never overlap (migrations 0009 and 0010;
    # events/log/_sql.py for SQLite, events/log/_postgres_append.py for PostgreSQL).
    sa.Column("first_id", _EventId, primary_key=True),
    sa.Column("last_id", _EventId, nullable=False),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sqlite_with_rowid=False,
)

streams = sa.Table(
    "kvl_streams",
    metadata,
    sa.Column("stream_id", sa.String(255), primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),
)

commands = sa.Table(
    "kvl_commands",
    metadata,
    sa.Column("command_id", sa.String(128), primary_key=True),
    sa.Column("stream_id", sa.String(255), nullable=False),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("stream_version", sa.Integer, nullable=False),
    sa.Column("digest", sa.LargeBinary, nullable=True),
)

checkpoints = sa.Table(
    "kvl_checkpoints",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("global_seq", sa.BigInteger, nullable=False),
)

snapshots = sa.Table(
    "kvl_snapshots",
    metadata,
    sa.Column("snapshot_id", _Seq, primary_key=True, autoincrement=True),
    sa.Column("global_seq", sa.BigInteger, nullable=False),
    sa.Column("schema_version", sa.Integer, nullable=False),
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("state", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

sa.Index("ix_kvl_snapshots_global_seq", snapshots.c.global_seq)

# --- the audit index (coordinator/audit) ---------------------------------------------------------
# A projection of the log for forensics: insert-only rows, each naming the global sequence of the
# event it came from, so a point-in-time question is an index range scan ("the last allocation of
# this slot at or before sequence N"). Written with the "audit" checkpoint in one transaction.
# Engines, pools and steps are per engine, so most tables lead with the engine id.

audit_slots = sa.Table(
    "kvl_audit_slots",
    metadata,
    # What happened to one slot's generations in one batch of the index (one `sync_index`
    # transaction) and one window of 2**16 sequences: its touches (allocated, reused (a ref taken),
    # released (a ref dropped), computed, stored_from, loaded_into, copied, freed) packed in log
    # order, as coordinator/audit/index.py describes (SlotTouch). A row per touch made the index
    # about four rows per event and its build insert-bound (issue 22; migration 0007).
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("pool", sa.Integer, nullable=False),
    sa.Column("block", sa.Integer, nullable=False),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    # The sequence of the row's first `allocated` touch (NULL: none) and how many it holds: the
    # last allocation at or before N is in the last row whose first allocation is.
    sa.Column("first_allocated", sa.BigInteger, nullable=True),
    sa.Column("allocations", sa.Integer, nullable=False),
    sa.Column("packed", sa.LargeBinary, nullable=False),
)
sa.Index("ix_kvl_audit_slots_block", audit_slots.c.engine, audit_slots.c.pool, audit_slots.c.block, audit_slots.c.first_seq)
# A pool's touches over a range of sequences (`kvledger audit timeline`): a row's touches lie in one
# window, so the rows start at or after the window of the range's start.
sa.Index("ix_kvl_audit_slots_pool", audit_slots.c.engine, audit_slots.c.pool, audit_slots.c.first_seq)

audit_owner_blocks = sa.Table(
    "kvl_audit_owner_blocks",
    metadata,
    # The slots one owner was allocated or reused in one batch of the index, packed in log order
    # (OwnerBlock: seq, kind, pool, block, generation). Migration 0007.
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("owner_id", sa.BigInteger, nullable=False),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("packed", sa.LargeBinary, nullable=False),
)
sa.Index(
    "ix_kvl_audit_owner_blocks_owner", audit_owner_blocks.c.engine, audit_owner_blocks.c.owner_id, audit_owner_blocks.c.first_seq
)

audit_key_blocks = sa.Table(
    "kvl_audit_key_blocks",
    metadata,
    # The device blocks of one content key under one namespace in one batch of the index: where
    # it was computed, which block each store read it from and each load wrote it into, packed
    # in log order (KeyBlock in coordinator/audit/index.py). Migration 0007.
    sa.Column("key", sa.LargeBinary, nullable=False),
    sa.Column("namespace_id", sa.LargeBinary, nullable=True),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("computed", sa.Integer, nullable=False),
    sa.Column("stored", sa.Integer, nullable=False),
    sa.Column("loaded", sa.Integer, nullable=False),
    sa.Column("last_loaded", sa.BigInteger, nullable=True),
    sa.Column("packed", sa.LargeBinary, nullable=False),
)
sa.Index("ix_kvl_audit_key_blocks_key", audit_key_blocks.c.key, audit_key_blocks.c.first_seq)
# A namespace's last load (`kvledger namespace list`'s last use), among the rows with loads only.
sa.Index(
    "ix_kvl_audit_key_blocks_loaded",
    audit_key_blocks.c.namespace_id,
    audit_key_blocks.c.last_loaded,
    sqlite_where=audit_key_blocks.c.last_loaded.is_not(None),
    postgresql_where=audit_key_blocks.c.last_loaded.is_not(None),
)

audit_owners = sa.Table(
    "kvl_audit_owners",
    metadata,
    # Owner lifetimes: started (detail "resumed" for a resumed request) and finished (the reason).
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("owner_id", sa.BigInteger, nullable=False),
    sa.Column("req_id", sa.Text, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.String(24), nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
)
sa.Index("ix_kvl_audit_owners_req", audit_owners.c.req_id, audit_owners.c.seq)
sa.Index("ix_kvl_audit_owners_owner", audit_owners.c.engine, audit_owners.c.owner_id)

audit_jobs = sa.Table(
    "kvl_audit_jobs",
    metadata,
    # A job's life: started (kind store, load or copy), reported (per rank), succeeded, failed,
    # fenced, fenced_rank_done.
    sa.Column("job_id", sa.BigInteger, nullable=False),
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.String(24), nullable=False),
    sa.Column("rank", sa.Integer, nullable=True),
    sa.Column("detail", sa.Text, nullable=False),
)
sa.Index("ix_kvl_audit_jobs_job", audit_jobs.c.job_id, audit_jobs.c.seq)

audit_keys = sa.Table(
    "kvl_audit_keys",
    metadata,
    # A content key's life in tiers, one event each: published (with each rank's checksum),
    # evicted, quarantined. Where it was computed, stored from and loaded into is in
    # kvl_audit_key_blocks (up to migration 0007, rows of kinds computed, stored and loaded here).
    sa.Column("key", sa.LargeBinary, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.String(24), nullable=False),
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("tier", sa.Text, nullable=False),
    sa.Column("pool", sa.Integer, nullable=False),
    sa.Column("namespace_id", sa.LargeBinary, nullable=True),
    sa.Column("job_id", sa.BigInteger, nullable=True),
    sa.Column("block", sa.Integer, nullable=True),
    sa.Column("generation", sa.Integer, nullable=True),
    sa.Column("tier_slot", sa.Integer, nullable=True),
    sa.Column("size_bytes", sa.BigInteger, nullable=True),
    sa.Column("checksums", sa.Text, nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
)
# kind in the key index: a hot key has tens of thousands of loads, and its other rows (or its
# newest loads) are found without reading each load's row.
sa.Index("ix_kvl_audit_keys_key", audit_keys.c.key, audit_keys.c.kind, audit_keys.c.seq)
sa.Index("ix_kvl_audit_keys_namespace", audit_keys.c.namespace_id, audit_keys.c.kind)

audit_refusals = sa.Table(
    "kvl_audit_refusals",
    metadata,
    # What the coordinator refused or dropped, the jobs it failed and the keys it quarantined.
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("kind", sa.String(24), nullable=False),
    sa.Column("subject", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
)
sa.Index("ix_kvl_audit_refusals_seq", audit_refusals.c.seq)

audit_engines = sa.Table(
    "kvl_audit_engines",
    metadata,
    # Engine incarnations: declared (with its namespace) and reset.
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("incarnation", sa.Integer, nullable=False),
    sa.Column("namespace_id", sa.LargeBinary, nullable=True),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.String(24), nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
)
sa.Index("ix_kvl_audit_engines_engine", audit_engines.c.engine, audit_engines.c.seq)

audit_namespaces = sa.Table(
    "kvl_audit_namespaces",
    metadata,
    sa.Column("namespace_id", sa.LargeBinary, primary_key=True),
    sa.Column("tenant", sa.Text, nullable=False),
    sa.Column("model_id", sa.Text, nullable=False),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
)

audit_decisions = sa.Table(
    "kvl_audit_decisions",
    metadata,
    # Namespace release decisions (seed 003): new, compatible (with its evidence, the id of a
    # verification run) and clear, from one namespace to another; and released (an abandoned
    # namespace cleaned up by `kvledger namespace gc`: no to_namespace). affected_keys: the keys
    # a clear quarantined or a release evicted.
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("outcome", sa.Text, nullable=False),
    sa.Column("from_namespace", sa.LargeBinary, nullable=False),
    sa.Column("to_namespace", sa.LargeBinary, nullable=True),
    sa.Column("affected_keys", sa.Integer, nullable=False),
    sa.Column("evidence", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
)
sa.Index("ix_kvl_audit_decisions_from", audit_decisions.c.from_namespace, audit_decisions.c.seq)
sa.Index("ix_kvl_audit_decisions_to", audit_decisions.c.to_namespace, audit_decisions.c.seq)

audit_steps = sa.Table(
    "kvl_audit_steps",
    metadata,
    # Every append: where it lies in the log and when it was recorded (--at-time), and for an
    # engine step its step number (--at-step; -1 for an append outside a step).
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("recorded_at", sa.Float, nullable=False),
)
sa.Index("ix_kvl_audit_steps_step", audit_steps.c.engine, audit_steps.c.step)
sa.Index("ix_kvl_audit_steps_time", audit_steps.c.recorded_at)
sa.Index("ix_kvl_audit_steps_seq", audit_steps.c.engine, audit_steps.c.first_seq)
sa.Index("ix_kvl_audit_steps_first", audit_steps.c.first_seq)

audit_observed = sa.Table(
    "kvl_audit_observed",
    metadata,
    # What an observed engine (vLLM, from its own KV events; coordinator/core/observe.py) said of one
    # block hash: stored or removed, by which incarnation, in which medium and group; seq is the
    # global sequence, source_seq the engine's own batch number. A `cleared` row (every hash of a
    # medium dropped) has an empty hash and group -1. Migration 0004.
    sa.Column("hash", sa.LargeBinary, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.String(24), nullable=False),
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("incarnation", sa.Integer, nullable=False),
    sa.Column("medium", sa.Text, nullable=False),
    sa.Column("grp", sa.Integer, nullable=False),
    sa.Column("dp_rank", sa.Integer, nullable=True),
    sa.Column("source_seq", sa.BigInteger, nullable=False),
)
sa.Index("ix_kvl_audit_observed_hash", audit_observed.c.hash, audit_observed.c.seq)
