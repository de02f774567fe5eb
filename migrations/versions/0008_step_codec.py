"""kvl_steps.codec: how a step's header and payload are stored (issue 22).

0: as they are (every row before this revision); 1: each compressed with LZ4 (block format, its
size in front). A 256-event step of the decider's mix packs 51 KB into 17 KB, so an append
writes a third of the pages, and the WAL its checkpoints copy and sync shrinks with it
(events/log/_sql.py, `pack_batches`). Old rows keep 0 and read as before; a downgrade writes
the compressed rows back as they were packed.

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


def upgrade() -> None:
    op.add_column("kvl_steps", sa.Column("codec", sa.SmallInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    # Every compressed step is written back as it was packed first: a log downgraded keeps every byte.
    bind = op.get_bind()
    steps = sa.table("kvl_steps", sa.column("first_seq"), sa.column("header"), sa.column("payload"), sa.column("codec"))
    while True:
        rows = bind.execute(
            sa.select(steps.c.first_seq, steps.c.header, steps.c.payload).where(steps.c.codec == 1).limit(1_000)
        ).all()
        if not rows:
            break
        bind.execute(
            steps.update().where(steps.c.first_seq == sa.bindparam("seq")),
            [
                {"seq": seq, "header": lz4.block.decompress(header), "payload": lz4.block.decompress(payload), "codec": 0}
                for seq, header, payload in rows
            ],
        )
    with op.batch_alter_table("kvl_steps") as batch:
        batch.drop_column("codec")
