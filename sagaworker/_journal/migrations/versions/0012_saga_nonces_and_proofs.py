"""a saga's nonce for its values' places, and the proof of an approval

Revision ID: 0012
Revises: 0011
Create Date: 2027-06-20 10:00:00

``sagaworker_sagas.place_nonce``: a saga journaled with SAGAWORKER_ENCRYPTION_KEYS seals
each of its values (and its entries') for its own nonce, so a saga id used again after a
prune never reads the pruned saga's values, and a clear value in such a saga is refused.
NULL for the sagas already there: their values' places are as they were.

``sagaworker_entries.approval_proof``: what only the approval secret makes (the approval's
nonce and an HMAC over the saga, the step, its task id, tool, arguments and approver),
checked by the worker before a gated tool runs. A step approved before this revision and
not yet run has none: its worker refuses it (FAILED, compensated), as it refuses an
approval written with SQL.

Both nullable with no default: an embedded journal of an earlier release gets them added
in place.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012'
down_revision: str | Sequence[str] | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('sagaworker_sagas') as batch:
        batch.add_column(sa.Column('place_nonce', sa.String(length=32), nullable=True))
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.add_column(sa.Column('approval_proof', sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.drop_column('approval_proof')
    with op.batch_alter_table('sagaworker_sagas') as batch:
        batch.drop_column('place_nonce')
