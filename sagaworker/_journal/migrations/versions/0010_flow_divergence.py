"""a flow held because its replay diverged from its journal

Revision ID: 0010
Revises: 0009
Create Date: 2027-06-01 10:00:00

A deploy that changes a flow's code meets sagas started under the old code. A replay that
diverges holds its saga (SPEC section 17) instead of compensating it:
``sagaworker_sagas.divergence`` is what the replay found (NULL for a saga not held) and
``diverged_at`` when a replay last found it (the sweeper replays a held flow again every
SAGAWORKER_DIVERGED_RETRY seconds). Patch markers need no column: an entry named
``patch:<id>``.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | Sequence[str] | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('sagaworker_sagas') as batch:
        batch.add_column(sa.Column('divergence', sa.Text(), nullable=True))
        batch.add_column(sa.Column('diverged_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('sagaworker_sagas') as batch:
        batch.drop_column('diverged_at')
        batch.drop_column('divergence')
