"""counters instead of clocks, the callers' tokens on decided rows, the journal's facts

Revision ID: 0006
Revises: 0005
Create Date: 2027-03-01 10:00:00

``sagaworker_sagas.advanced_seen``: how many of a flow's steps had an outcome in the
journal its last replay read; the sweeper re-sends an advance while more have one (it
compared two hosts' clocks before, and lost advances that raced a replay).
``sagaworker_sagas.fail_token`` and ``sagaworker_entries.decided_by``: the token of the
move that asked a saga to fail (abort, deadline) or journaled an entry's outcome from
outside its attempt (found in doubt, cancelled), so that the move replayed after a lost
COMMIT reply answers as its first run did, pages included; ``sagaworker_audit.token``
likewise for an operator's action. ``sagaworker_facts``: the
fingerprint of the key values are sealed with.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | Sequence[str] | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('sagaworker_sagas') as batch:
        batch.add_column(sa.Column('advanced_seen', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('fail_token', sa.String(32), nullable=True))
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.add_column(sa.Column('decided_by', sa.String(32), nullable=True))
    with op.batch_alter_table('sagaworker_audit') as batch:
        batch.add_column(sa.Column('token', sa.String(32), nullable=True))
    op.create_table('sagaworker_facts',
                    sa.Column('name', sa.String(64), primary_key=True),
                    sa.Column('value', sa.Text(), nullable=False))


def downgrade() -> None:
    op.drop_table('sagaworker_facts')
    with op.batch_alter_table('sagaworker_audit') as batch:
        batch.drop_column('token')
    with op.batch_alter_table('sagaworker_entries') as batch:
        batch.drop_column('decided_by')
    with op.batch_alter_table('sagaworker_sagas') as batch:
        batch.drop_column('fail_token')
        batch.drop_column('advanced_seen')
