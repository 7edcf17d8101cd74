"""the trace context of a saga, of each step's enqueue and of its run

Revision ID: 0008
Revises: 0007
Create Date: 2027-05-01 10:00:00

Where OpenTelemetry is configured, one trace follows a saga through every process, and
its context travels in the journal (never only in message headers, which a message sent
again by the relay or the sweeper does not carry): ``sagaworker_sagas.trace_context``,
the saga's start span; ``sagaworker_entries.trace_context``, the step's enqueue span (the
parent of every run of the step); ``sagaworker_entries.span_context``, the run that
journaled the step's outcome (what its undo's span links to). W3C trace context as JSON
text; NULL where nothing was traced.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | Sequence[str] | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('sagaworker_sagas') as batch:
        batch.add_column(sa.Column('trace_context', sa.Text(), nullable=True))
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.add_column(sa.Column('trace_context', sa.Text(), nullable=True))
        batch.add_column(sa.Column('span_context', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.drop_column('span_context')
        batch.drop_column('trace_context')
    with op.batch_alter_table('sagaworker_sagas') as batch:
        batch.drop_column('trace_context')
