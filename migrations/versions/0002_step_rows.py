"""One row per step: kvl_steps (the step's payloads concatenated, with a header) and
kvl_event_ids (event ids stay unique) replace the row-per-event kvl_events.

Existing events move over as one-event steps, so positions, ids and payloads are kept byte for
byte; the downgrade splits the steps back into rows.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from events.log._contract import PendingEvent, StoredStep, pack_step

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_Seq = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_BATCH = 10_000
_EVENT_COLUMNS = (
    "global_seq",
    "event_id",
    "stream_id",
    "stream_version",
    "step",
    "recorded_at",
    "event_type",
    "schema_version",
    "payload",
)


def _create_step_tables() -> None:
    op.create_table(
        "kvl_steps",
        sa.Column("first_seq", _Seq, primary_key=True, autoincrement=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("stream_id", sa.String(255), nullable=False),
        sa.Column("first_version", sa.Integer, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
        sa.Column("schemas", sa.Text, nullable=False),
        sa.Column("header", sa.LargeBinary, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("stream_id", "first_version", name="uq_kvl_steps_stream_version"),
    )
    op.create_table(
        "kvl_event_ids",
        sa.Column("event_id", sa.String(64), primary_key=True),
        sa.Column("global_seq", sa.BigInteger, nullable=False),
        sqlite_with_rowid=False,
    )


def upgrade() -> None:
    _create_step_tables()
    bind = op.get_bind()
    events = sa.table("kvl_events", *(sa.column(name) for name in _EVENT_COLUMNS))
    steps = sa.table(
        "kvl_steps",
        *(
            sa.column(name)
            for name in (
                "first_seq",
                "last_seq",
                "stream_id",
                "first_version",
                "step",
                "recorded_at",
                "schemas",
                "header",
                "payload",
            )
        ),
    )
    ids = sa.table("kvl_event_ids", sa.column("event_id"), sa.column("global_seq"))
    last = 0
    while rows := bind.execute(
        sa.select(events).where(events.c.global_seq > last).order_by(events.c.global_seq).limit(_BATCH)
    ).all():
        step_rows, id_rows = [], []
        for row in rows:
            pending = PendingEvent(
                event_id=row.event_id,
                step=row.step,
                recorded_at=row.recorded_at,
                event_type=row.event_type,
                schema_version=row.schema_version,
                payload=bytes(row.payload),
            )
            schemas, header, payload = pack_step([pending])
            step_rows.append(
                {
                    "first_seq": row.global_seq,
                    "last_seq": row.global_seq,
                    "stream_id": row.stream_id,
                    "first_version": row.stream_version,
                    "step": row.step,
                    "recorded_at": row.recorded_at,
                    "schemas": schemas,
                    "header": header,
                    "payload": payload,
                }
            )
            id_rows.append({"event_id": row.event_id, "global_seq": row.global_seq})
        bind.execute(steps.insert(), step_rows)
        bind.execute(ids.insert(), id_rows)
        last = rows[-1].global_seq
    op.drop_table("kvl_events")


def downgrade() -> None:
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
    bind = op.get_bind()
    steps = sa.table(
        "kvl_steps",
        *(sa.column(name) for name in ("first_seq", "last_seq", "stream_id", "first_version", "schemas", "header", "payload")),
    )
    events = sa.table("kvl_events", *(sa.column(name) for name in _EVENT_COLUMNS))
    last = 0
    while rows := bind.execute(sa.select(steps).where(steps.c.first_seq > last).order_by(steps.c.first_seq).limit(_BATCH)).all():
        stored = [
            event
            for row in rows
            for event in StoredStep(
                row.first_seq, row.last_seq, row.stream_id, row.first_version, row.schemas, bytes(row.header), bytes(row.payload)
            ).events()
        ]
        bind.execute(
            events.insert(),
            [
                dict(
                    zip(
                        _EVENT_COLUMNS,
                        (
                            e.global_seq,
                            e.event_id,
                            e.stream_id,
                            e.stream_version,
                            e.step,
                            e.recorded_at,
                            e.event_type,
                            e.schema_version,
                            e.payload,
                        ),
                        strict=True,
                    )
                )
                for e in stored
            ],
        )
        last = rows[-1].first_seq
    op.drop_table("kvl_event_ids")
    op.drop_table("kvl_steps")
