"""the caller's id for a step (an agent framework's tool-call id)

Revision ID: 0007
Revises: 0006
Create Date: 2027-04-01 10:00:00

``sagaworker_entries.call_id``: the id an agent framework gave the tool call that
journaled this step (``Saga.enqueue_call``). Unique within a saga, so a resumed or
replayed agent run that repeats the call gets the first step back, never a second one.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | Sequence[str] | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.add_column(sa.Column('call_id', sa.String(200), nullable=True))
    op.create_index('ux_sagaworker_entries_call_id', 'sagaworker_entries',
                    ['saga_id', 'call_id'], unique=True)


def downgrade() -> None:
    op.drop_index('ux_sagaworker_entries_call_id', table_name='sagaworker_entries')
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.drop_column('call_id')
