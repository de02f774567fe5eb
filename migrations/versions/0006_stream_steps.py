"""kvl_steps(stream_id, last_seq): one stream's steps read in order without the others' (issue 17).

A worker's catch-up (the sidecar's DecisionHub) wants only its engine's stream, yet read every
stream's steps and dropped the rest: 20 hostile subscriptions from sequence 0, as workers of
engines with few or no steps, kept the sidecar reading the whole log. `EventLog.read_stream_steps`
reads one stream's steps after a sequence by this index.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_kvl_steps_stream_last", "kvl_steps", ["stream_id", "last_seq"])


def downgrade() -> None:
    op.drop_index("ix_kvl_steps_stream_last", table_name="kvl_steps")
