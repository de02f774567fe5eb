"""The log's tables, as SQLAlchemy Core metadata. migrations/ versions create exactly these."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

# SQLite only autoincrements an INTEGER PRIMARY KEY (the rowid alias); PostgreSQL gets BIGINT.
_Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

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
    sa.UniqueConstraint("stream_id", "first_version", name="uq_kvl_steps_stream_version"),
)

event_ids = sa.Table(
    "kvl_event_ids",
    metadata,
    # Event ids are unique across the whole log (DESIGN.md, "The log"); the primary key enforces it.
    sa.Column("event_id", sa.String(64), primary_key=True),
    sa.Column("global_seq", sa.BigInteger, nullable=False),
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
