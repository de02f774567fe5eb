"""kvl_steps.compression: a step row's header and payload stored as LZ4 blocks (issue 22).

An append wrote every page its step touched twice (into the WAL, then into the database file at a
checkpoint); LZ4 makes the rows about 3x smaller (events/log/_compression.py). The upgrade adds
the column, 0 for every row written before it (kept as they are: nothing is rewritten). The
downgrade decompresses the rows written since, in batches, then drops the column.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from __future__ import annotations

import lz4.block
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_BATCH = 1_000
_LZ4 = 1
"""This revision's value for LZ4 blocks, each prefixed with its size (lz4.block's store_size)."""


def upgrade() -> None:
    with op.batch_alter_table("kvl_steps") as table:
        table.add_column(sa.Column("compression", sa.SmallInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    bind = op.get_bind()
    steps = sa.table("kvl_steps", *(sa.column(name) for name in ("first_seq", "header", "payload", "compression")))
    last = 0
    while rows := bind.execute(
        sa.select(steps.c.first_seq, steps.c.header, steps.c.payload)
        .where(steps.c.first_seq > last, steps.c.compression == _LZ4)
        .order_by(steps.c.first_seq)
        .limit(_BATCH)
    ).all():
        for row in rows:
            bind.execute(
                steps.update()
                .where(steps.c.first_seq == row.first_seq)
                .values(
                    header=lz4.block.decompress(bytes(row.header)),
                    payload=lz4.block.decompress(bytes(row.payload)),
                    compression=0,
                )
            )
        last = rows[-1].first_seq
    with op.batch_alter_table("kvl_steps") as table:
        table.drop_column("compression")
