"""releases of a claim stopped before its tool started, counted per step

Revision ID: 0011
Revises: 0010
Create Date: 2027-06-15 10:00:00

An attempt stopped between its claim and its tool's call (its own setup failed) releases
its claim, and the step is sent again, at most SAGAWORKER_MAX_RERUNS times. Those
releases were told from the step's attempts, which count Celery's retries too: a step
retried by Celery that often went in doubt at its first such stop, though its tool never
started. ``sagaworker_entries.releases`` counts the releases alone (NULL: none; nullable
with no default, so an embedded journal of an earlier release gets it added in place).
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | Sequence[str] | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.add_column(sa.Column('releases', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.drop_column('releases')
