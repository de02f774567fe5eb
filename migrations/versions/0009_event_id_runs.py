"""kvl_id_runs: a step whose event ids ascend, all above every id the log holds, keeps them as one
run (its lowest and highest id) instead of a kvl_event_ids row each (issue 22).

The ledger's ids are UUIDv7s, made in order, so nearly every step is such a run. A row per id
was most of a SQLite append: 256 ids inserted in one statement took ~150 us of an append's
~300 us, and the commit ~45 us more for their pages (a raw sqlite3 probe), and
ops/bench/peer_eventsourcing.py's append ratio went from 6.3-7.5 to 9.3-9.4 with them left out.
Runs never overlap (each begins above every run before it), so an id is in the log when it is a
kvl_event_ids row, or inside a run's bounds and listed in that run's step header
(events/log/_sqlite_append.py, `SqliteRows.insert_step`). Rows before this revision stay in kvl_event_ids;
a downgrade writes every run's ids back there.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations._id_runs import runs_back_to_rows

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kvl_id_runs",
        sa.Column("first_id", sa.String(64), primary_key=True),
        sa.Column("last_id", sa.String(64), nullable=False),
        sa.Column("first_seq", sa.BigInteger, nullable=False),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    # Every run's ids go back to kvl_event_ids, a row each, as an append before 0009 wrote them.
    runs_back_to_rows(op.get_bind())
    op.drop_table("kvl_id_runs")
