"""The log's tables, as SQLAlchemy Core metadata. migrations/ versions create exactly these."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

# SQLite only autoincrements an INTEGER PRIMARY KEY (the rowid alias); PostgreSQL gets BIGINT.
_Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

events = sa.Table(
    "kvl_events",
    metadata,
    sa.Column("global_seq", _Seq, primary_key=True, autoincrement=True),
    sa.Column("event_id", sa.String(64), nullable=False, unique=True),
    sa.Column("stream_id", sa.String(255), nullable=False),
    sa.Column("stream_version", sa.Integer, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("recorded_at", sa.Float, nullable=False),
    sa.Column("event_type", sa.String(64), nullable=False),
    sa.Column("schema_version", sa.SmallInteger, nullable=False),
    sa.Column("payload", sa.LargeBinary, nullable=False),
    sa.UniqueConstraint("stream_id", "stream_version", name="uq_kvl_events_stream_version"),
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
