"""The audit index packs what events name many of (issue 22): kvl_audit_slots holds one row per
slot per batch of the index with its touches packed, instead of one row per touch; the new
kvl_audit_owner_blocks holds the slots each owner took, and kvl_audit_key_blocks where each
content key was computed, stored from and loaded into (before, rows of kinds `computed`, `stored`
and `loaded` in kvl_audit_keys, which keeps its rows of one event each). coordinator/audit/index.py
describes the packed entries. Building the index made about four rows per event and was bound by
their inserts (ops/bench/audit.py).

The index is a cache of the log: the upgrade empties it and its checkpoint, and the next catch-up
(`kvledger audit`, the audit API, `kvledger fleet`) rebuilds it from the log in the new format.
The downgrade does the same the other way.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# The tables as this revision creates them, frozen here (not read from events/log/schema.py): a
# later revision that changes them must not change what this one created.
_metadata = sa.MetaData()
_slots = sa.Table(
    "kvl_audit_slots",
    _metadata,
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("pool", sa.Integer, nullable=False),
    sa.Column("block", sa.Integer, nullable=False),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("first_allocated", sa.BigInteger, nullable=True),
    sa.Column("allocations", sa.Integer, nullable=False),
    sa.Column("packed", sa.LargeBinary, nullable=False),
)
sa.Index("ix_kvl_audit_slots_block", _slots.c.engine, _slots.c.pool, _slots.c.block, _slots.c.first_seq)
sa.Index("ix_kvl_audit_slots_pool", _slots.c.engine, _slots.c.pool, _slots.c.first_seq)
_owner_blocks = sa.Table(
    "kvl_audit_owner_blocks",
    _metadata,
    sa.Column("engine", sa.Text, nullable=False),
    sa.Column("owner_id", sa.BigInteger, nullable=False),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("packed", sa.LargeBinary, nullable=False),
)
sa.Index("ix_kvl_audit_owner_blocks_owner", _owner_blocks.c.engine, _owner_blocks.c.owner_id, _owner_blocks.c.first_seq)
_key_blocks = sa.Table(
    "kvl_audit_key_blocks",
    _metadata,
    sa.Column("key", sa.LargeBinary, nullable=False),
    sa.Column("namespace_id", sa.LargeBinary, nullable=True),
    sa.Column("first_seq", sa.BigInteger, nullable=False),
    sa.Column("computed", sa.Integer, nullable=False),
    sa.Column("stored", sa.Integer, nullable=False),
    sa.Column("loaded", sa.Integer, nullable=False),
    sa.Column("last_loaded", sa.BigInteger, nullable=True),
    sa.Column("packed", sa.LargeBinary, nullable=False),
)
sa.Index("ix_kvl_audit_key_blocks_key", _key_blocks.c.key, _key_blocks.c.first_seq)
sa.Index(
    "ix_kvl_audit_key_blocks_loaded",
    _key_blocks.c.namespace_id,
    _key_blocks.c.last_loaded,
    sqlite_where=_key_blocks.c.last_loaded.is_not(None),
    postgresql_where=_key_blocks.c.last_loaded.is_not(None),
)

# kvl_audit_slots as revision 0003 created it: a row per touch.
_metadata_0003 = sa.MetaData()
_slots_0003 = sa.Table(
    "kvl_audit_slots",
    _metadata_0003,
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
sa.Index("ix_kvl_audit_slots_seq", _slots_0003.c.engine, _slots_0003.c.pool, _slots_0003.c.block, _slots_0003.c.seq)
sa.Index("ix_kvl_audit_slots_owner", _slots_0003.c.engine, _slots_0003.c.owner_id, _slots_0003.c.kind)

_OTHER_INDEX_TABLES = (
    "kvl_audit_owners",
    "kvl_audit_jobs",
    "kvl_audit_keys",
    "kvl_audit_refusals",
    "kvl_audit_engines",
    "kvl_audit_namespaces",
    "kvl_audit_decisions",
    "kvl_audit_steps",
    "kvl_audit_observed",
)


def _empty_the_index() -> None:
    """Every row of the index and its checkpoint: the next catch-up rebuilds it from the log."""
    for table in _OTHER_INDEX_TABLES:
        op.execute(f"DELETE FROM {table}")
    op.execute("DELETE FROM kvl_checkpoints WHERE name = 'audit'")


def upgrade() -> None:
    bind = op.get_bind()
    _slots_0003.drop(bind)
    for table in (_slots, _owner_blocks, _key_blocks):
        table.create(bind)
    _empty_the_index()


def downgrade() -> None:
    bind = op.get_bind()
    for table in (_key_blocks, _owner_blocks, _slots):
        table.drop(bind)
    _slots_0003.create(bind)
    _empty_the_index()
