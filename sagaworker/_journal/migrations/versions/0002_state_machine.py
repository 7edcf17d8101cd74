"""attempt tokens, resend backoff, flows and deadlines

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 17:40:00

"""
from collections.abc import Sequence
from typing import Any

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision: str = '0002'
down_revision: str | Sequence[str] | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_json = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')
_ts = sa.DateTime(timezone=True)

SAGA_COLUMNS: list[sa.Column[Any]] = [
    sa.Column('chain_token', sa.String(length=32), nullable=True),
    sa.Column('closed_by', sa.String(length=32), nullable=True),
    sa.Column('resend_at', _ts, nullable=True),
    sa.Column('resends', sa.Integer(), server_default='0', nullable=False),
    sa.Column('deadline_at', _ts, nullable=True),
    sa.Column('flow', sa.String(length=300), nullable=True),
    sa.Column('flow_args', _json, nullable=True),
    sa.Column('flow_kwargs', _json, nullable=True),
    sa.Column('result', _json, nullable=True),
    sa.Column('advanced_at', _ts, nullable=True),
    sa.Column('idle_reported_at', _ts, nullable=True),
]
ENTRY_COLUMNS: list[sa.Column[Any]] = [
    sa.Column('attempt_token', sa.String(length=32), nullable=True),
    sa.Column('reruns', sa.Integer(), server_default='0', nullable=False),
    sa.Column('retry_due_at', _ts, nullable=True),
    sa.Column('celery_retries', sa.Integer(), server_default='0', nullable=False),
    sa.Column('resend_at', _ts, nullable=True),
    sa.Column('resends', sa.Integer(), server_default='0', nullable=False),
    sa.Column('undo_token', sa.String(length=32), nullable=True),
]


def upgrade() -> None:
    with op.batch_alter_table('sagaworker_sagas') as batch:
        for col in SAGA_COLUMNS:
            batch.add_column(col._copy())
        batch.create_index('ix_sagaworker_sagas_deadline', ['deadline_at'])
    with op.batch_alter_table('sagaworker_entries') as batch:
        for col in ENTRY_COLUMNS:
            batch.add_column(col._copy())


def downgrade() -> None:
    with op.batch_alter_table('sagaworker_entries') as batch:
        for col in ENTRY_COLUMNS:
            batch.drop_column(col.name)
    with op.batch_alter_table('sagaworker_sagas') as batch:
        batch.drop_index('ix_sagaworker_sagas_deadline')
        for col in SAGA_COLUMNS:
            batch.drop_column(col.name)
