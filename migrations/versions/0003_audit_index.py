"""The audit index (coordinator/audit): insert-only rows per slot, owner, job, key, refusal,
engine, namespace, namespace release decision and step, each naming the global sequence of its event. Built from the log by
`kvledger audit` (or the sidecar) and checkpointed as "audit"; dropping it loses nothing.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from events.log import schema as t

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# kvl_audit_slots as this revision created it (a row per touch), frozen here when 0007 packed it.
_metadata = sa.MetaData()
_slots = sa.Table(
    "kvl_audit_slots",
    _metadata,
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("pool", sa.Integer, nullable=False),
    sa.Column("block", sa.Integer, nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.String(24), nullable=False),
    sa.Column("owner_id", sa.BigInteger, nullable=True),
    sa.Column("job_id", sa.BigInteger, nullable=True),
    sa.Column("key", sa.LargeBinary, nullable=True),
)
sa.Index("ix_kvl_audit_slots_seq", _slots.c.engine, _slots.c.pool, _slots.c.block, _slots.c.seq)
sa.Index("ix_kvl_audit_slots_owner", _slots.c.engine, _slots.c.owner_id, _slots.c.kind)

_TABLES = (
    _slots,
    t.audit_owners,
    t.audit_jobs,
    t.audit_keys,
    t.audit_refusals,
    t.audit_engines,
    t.audit_namespaces,
    t.audit_decisions,
    t.audit_steps,
)


# Created from the metadata as it stands at this revision. A later revision that changes one of
# these tables must first copy its definition here, so this revision keeps creating what it did.


def upgrade() -> None:
    bind = op.get_bind()
    for table in _TABLES:
        table.create(bind)  # with its indexes, exactly as the metadata declares them


def downgrade() -> None:
    bind = op.get_bind()
    for table in reversed(_TABLES):
        table.drop(bind)
    op.execute("DELETE FROM kvl_checkpoints WHERE name = 'audit'")
