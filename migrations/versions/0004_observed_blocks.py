"""kvl_audit_observed: the audit index of observed engines' block hashes (vLLM's KV events,
recorded by `kvledger ingest vllm`): stored, removed and cleared, per engine incarnation, medium
and group, with the global and the engine's own sequence numbers (`kvledger audit hash`).

Logs written before this revision hold no observed events, so the new table starts empty and the
index's checkpoint stands. The downgrade drops the table and empties the rest of the audit index
with its checkpoint: re-upgraded, the index is rebuilt from the log, so no observed row is missing
(the index is a cache of the log).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# The table as this revision creates it, frozen here (not read from events/log/schema.py): a
# later revision that changes it must not change what this one created.
_metadata = sa.MetaData()
_observed = sa.Table(
    "kvl_audit_observed",
    _metadata,
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
sa.Index("ix_kvl_audit_observed_hash", _observed.c.hash, _observed.c.seq)

_INDEX_TABLES_0003 = (
    "kvl_audit_slots",
    "kvl_audit_owners",
    "kvl_audit_jobs",
    "kvl_audit_keys",
    "kvl_audit_refusals",
    "kvl_audit_engines",
    "kvl_audit_namespaces",
    "kvl_audit_decisions",
    "kvl_audit_steps",
)


def upgrade() -> None:
    _observed.create(op.get_bind())


def downgrade() -> None:
    _observed.drop(op.get_bind())
    for table in _INDEX_TABLES_0003:
        op.execute(f"DELETE FROM {table}")
    op.execute("DELETE FROM kvl_checkpoints WHERE name = 'audit'")
