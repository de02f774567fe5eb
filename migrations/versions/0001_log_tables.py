"""The log's tables: events, streams, command ids, checkpoints, snapshots.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "kvl_events",
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
    op.create_table(
        "kvl_streams",
        sa.Column("stream_id", sa.String(255), primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
    )
    op.create_table(
        "kvl_commands",
        sa.Column("command_id", sa.String(128), primary_key=True),
        sa.Column("stream_id", sa.String(255), nullable=False),
        sa.Column("first_seq", sa.BigInteger, nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("stream_version", sa.Integer, nullable=False),
    )
    op.create_table(
        "kvl_checkpoints",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("global_seq", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "kvl_snapshots",
        sa.Column("snapshot_id", _Seq, primary_key=True, autoincrement=True),
        sa.Column("global_seq", sa.BigInteger, nullable=False),
        sa.Column("schema_version", sa.Integer, nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("state", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_kvl_snapshots_global_seq", "kvl_snapshots", ["global_seq"])


def downgrade() -> None:
    for table in ("kvl_snapshots", "kvl_checkpoints", "kvl_commands", "kvl_streams", "kvl_events"):
        op.drop_table(table)
