"""kvl_commands.digest: the content a command id stands for (issue 17). A command id sent again
with other content (the same step number with other commands, an Execute reusing an id with
another command) was answered with the first one's events as a duplicate; the ledger now keeps
each id's digest and refuses such a retry `command_id_reused`.

Rows written before this revision have no digest (NULL): a retry of one of their ids is checked
as before (the step and clock of a Step, the job and rank of a Report). The downgrade drops the
column.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("kvl_commands") as table:
        table.add_column(sa.Column("digest", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("kvl_commands") as table:
        table.drop_column("digest")
