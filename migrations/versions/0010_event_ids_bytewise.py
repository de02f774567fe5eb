"""Event ids compare byte by byte on PostgreSQL too (collation "C"), so that PostgreSQL keeps a
step whose ids ascend above every id the log holds as one kvl_id_runs row, as SQLite does since
0009 (issue 22).

A run's bounds are compared with the append's own `<` (Python compares str by code point, which
is UTF-8's byte order); PostgreSQL compared the id columns in the database's locale, so it kept
every id as a kvl_event_ids row. Here kvl_event_ids.event_id and kvl_id_runs' bounds take
collation "C" (their primary key indexes are rebuilt in that order); equality, and so
uniqueness, is unchanged. SQLite's default collation (BINARY) is already byte order: nothing to
do there. A downgrade writes PostgreSQL's runs back as rows.

On PostgreSQL the change rebuilds kvl_event_ids' primary key index (the table keeps its rows as
they are: the type is the same), which held a key per event until now, under an exclusive lock:
appends wait for it. 1,000,000 rows took 0.4 s here (a probe, not kept); on a large log run
`kvledger db upgrade` in a quiet hour.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

from migrations._id_runs import runs_back_to_rows

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_COLUMNS = (("kvl_event_ids", "event_id"), ("kvl_id_runs", "first_id"), ("kvl_id_runs", "last_id"))


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column in _COLUMNS:
        op.execute(f'ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar(64) COLLATE "C"')


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    for table, column in _COLUMNS:
        op.execute(f'ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar(64) COLLATE "default"')
    # The runs' bounds mean nothing in the locale's order: their ids go back to rows. After the
    # columns change, not before: a statement prepared on them before would be stale for 0009's
    # downgrade, run next on the same connection (asyncpg refuses a stale cached plan).
    runs_back_to_rows(bind)
